"""What an installed hostcallback holds: the compiled core inside the package, type information,
metadata, the console scripts, and no pointers to documents that are not installed."""

import importlib.metadata
import importlib.resources
import importlib.util
import pathlib
import subprocess
import sys

import pytest

import hostcallback
import hostcallback.consumer
from helpers import ROOT


def test_the_compiled_core_lives_inside_the_package():
    from hostcallback._native import outfeed

    assert outfeed.__name__ == "hostcallback._native._hostcallback_outfeed"
    # An editable install keeps the built file apart from the sources, still under the package.
    assert pathlib.Path(outfeed.__file__).parent.parts[-2:] == ("hostcallback", "_native")


def test_the_consumers_framer_is_compiled_inside_the_consumer_package():
    from hostcallback.consumer.native_frames import frames, missing

    assert missing is None and frames.__name__ == "hostcallback.consumer._frames"
    assert pathlib.Path(frames.__file__).parent.parts[-2:] == ("hostcallback", "consumer")
    assert not list(pathlib.Path(frames.__file__).parent.glob("_native"))  # no C++ installed


def test_site_packages_holds_no_top_level_module_of_ours():
    assert importlib.util.find_spec("_hostcallback_outfeed") is None
    assert importlib.util.find_spec("_frames") is None


def test_the_package_is_marked_typed():
    assert importlib.resources.files("hostcallback").joinpath("py.typed").is_file()
    classifiers = importlib.metadata.metadata("hostcallback").get_all("Classifier")
    assert "Typing :: Typed" in classifiers


def test_metadata_has_classifiers_and_keywords():
    metadata = importlib.metadata.metadata("hostcallback")
    assert "License :: OSI Approved :: Apache Software License" in metadata.get_all("Classifier")
    assert "jax" in metadata["Keywords"]


@pytest.mark.parametrize("script,target", [
    ("hostcallback", "hostcallback.__main__:main"),
    ("hostcallback-consumer", "hostcallback.consumer.__main__:main")])
def test_console_scripts_are_installed(script, target):
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=script)
    assert entry.value == target


def test_hostcallback_consumer_is_python_m_hostcallback_consumer(capsys):
    (entry,) = importlib.metadata.entry_points(group="console_scripts",
                                               name="hostcallback-consumer")
    with pytest.raises(SystemExit) as info:
        entry.load()(["--help"])
    assert info.value.code == 0
    assert "tail" in capsys.readouterr().out


def test_a_users_own_consumer_module_does_not_shadow_ours(tmp_path):
    (tmp_path / "consumer.py").write_text("raise SystemExit('the user\\'s consumer.py ran')\n")
    cli = subprocess.run([sys.executable, "-m", "hostcallback.consumer", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0 and "tail" in cli.stdout, cli.stderr
    imported = subprocess.run(
        [sys.executable, "-c", "from hostcallback.consumer import tap_to, FileSink; print('ok')"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert imported.stdout == "ok\n", imported.stderr


def test_the_install_has_no_top_level_consumer_package():
    files = importlib.metadata.files("hostcallback") or []
    assert [str(f) for f in files if f.parts[0] == "consumer"] == []


@pytest.mark.parametrize("package", [hostcallback, hostcallback.consumer])
def test_no_docstring_or_message_points_to_a_docs_file(package):
    """docs/ is not installed; code names a document by its title instead."""
    root = pathlib.Path(package.__file__).parent
    offenders = [f"{path.relative_to(root)}:{number}"
                 for path in sorted(root.rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if "docs/" in line]
    assert offenders == []


def test_the_build_directory_is_kept_per_python_and_platform():
    """Installing again with --no-build-isolation (extras added later) reuses the compiled core:
    5 s instead of about 30 s on this project's CI machine."""
    import tomllib

    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert settings["tool"]["scikit-build"]["build-dir"] == "build/{wheel_tag}"
