"""Every ```python block of README.md and docs/*.md runs as written, imports included.

Each block runs on its own, in a fresh interpreter, in an empty directory (samples may write
files). Blocks in other languages (```bash, ```text, a bare ``` for diagrams) are not run. A
python block that must not run (it needs a pod, a server, a second host) says so on the line
just before its fence:

    <!-- docs-test: skip (needs jax.distributed on a pod) -->
    ```python

A block that uses what the portable mode lacks says so the same way, and is skipped only there:

    <!-- docs-test: needs-internals (a jit over a sharded mesh) -->
    ```python
"""

import pathlib
import re

import pytest

from helpers import ROOT, run_python

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"^<!-- docs-test: skip \(.+\) -->$")
INTERNALS_MARKER = re.compile(r"^<!-- docs-test: needs-internals \((.+)\) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
LANGUAGES_NOT_RUN = {"", "bash", "sh", "console", "text", "toml", "json", "yaml", "cpp", "c"}


def _blocks(path: pathlib.Path):
    """(language, first line number, code, skipped, what it needs of JAX's internals or None)
    for each fenced block of a document."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        start, language = index, match.group(1)
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
        before = lines[start - 1] if start > 0 else ""
        needs = INTERNALS_MARKER.match(before)
        blocks.append((language, start + 1, "\n".join(lines[start + 1:end]) + "\n",
                       bool(SKIP_MARKER.match(before)), needs.group(1) if needs else None))
        index = end + 1
    return blocks


ALL_BLOCKS = [(path, *block) for path in DOCUMENTS for block in _blocks(path)]
SAMPLES = [pytest.param(code, id=f"{path.name}:{line}",
                        marks=[pytest.mark.needs_internals(needs)] if needs else [])
           for path, language, line, code, skipped, needs in ALL_BLOCKS
           if language == "python" and not skipped]


def test_the_documents_have_samples_to_run():
    assert len(SAMPLES) >= 10
    assert any(path.name == "README.md" for path, language, *_ in ALL_BLOCKS
               if language == "python")


def test_every_fence_names_a_language_and_skips_say_why():
    """An unnamed or misspelt language would silently not run; a skip marker away from a
    python fence would silently do nothing."""
    for path, language, line, _code, skipped, needs in ALL_BLOCKS:
        assert language == "python" or language in LANGUAGES_NOT_RUN, (
            f"{path.name}:{line}: fence language {language!r}; use ```python (run by this "
            f"test) or one of {sorted(LANGUAGES_NOT_RUN)}")
        assert not (skipped or needs) or language == "python", (
            f"{path.name}:{line}: a docs-test marker belongs before a ```python fence")
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        for number, text in enumerate(lines):
            if text.startswith("<!-- docs-test"):
                assert ((SKIP_MARKER.match(text) or INTERNALS_MARKER.match(text))
                        and lines[number + 1] == "```python"), (
                    f"{path.name}:{number + 1}: write the marker as '<!-- docs-test: skip "
                    "(reason) -->' or '<!-- docs-test: needs-internals (what) -->' on the line "
                    "just before a ```python fence")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("code", SAMPLES)
def test_sample_runs_as_written(code, tmp_path):
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
