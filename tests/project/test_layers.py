"""The package's layers, as docs/architecture.md names them: no module imports one of a higher
layer, and no import cycle, counting imports inside functions too."""

import ast
import pathlib

import pytest

from helpers import ROOT

# Where each module's folder lies: the repository's consumer/ is installed as hostcallback.consumer.
FOLDERS = {"hostcallback": ROOT / "hostcallback", "hostcallback.consumer": ROOT / "consumer"}

# Lowest first; a module may import its own layer and those below. The first matching prefix
# (longest first) names a module's layer. The folders are layers of their own: _records is what
# both sides of a tap share, _trace what a tap becomes in a computation, _host what happens to
# its record on the host; the two sides meet only in _records and above them.
LAYERS = [
    ("basics", ["hostcallback._native", "hostcallback._jax", "hostcallback.config",
                "hostcallback.versions", "hostcallback.errors", "hostcallback.flavors"]),
    ("what both sides share", ["hostcallback._records"]),
    ("the two sides of a tap", ["hostcallback._trace", "hostcallback._host"]),
    ("start, barrier and stop", ["hostcallback.lifecycle"]),
    ("building a tap", ["hostcallback.tapping", "hostcallback.served_callbacks"]),
    ("the public API", ["hostcallback.api", "hostcallback.addons", "hostcallback.testing",
                        "hostcallback.jax_callbacks", "hostcallback.debug", "hostcallback"]),
    ("add-ons", ["hostcallback.consumer"]),
    ("the command line", ["hostcallback.__main__"]),
]
SIDES = ("hostcallback._trace", "hostcallback._host")


def modules() -> dict[str, pathlib.Path]:
    """Every module by name: its .py file, or for a compiled one its .pyi stub."""
    found = {}
    for package, folder in FOLDERS.items():
        stubs = [stub for stub in folder.rglob("*.pyi") if not stub.with_suffix(".py").exists()]
        for path in [*folder.rglob("*.py"), *stubs]:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The known modules ``name`` imports anywhere in its file; ``from package import module``
    counts as importing the module (the package's own __init__ is imported either way)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            out.update(submodules or {base})
    return {target for target in out if target in known and target != name}


def layer_of(name: str) -> int:
    best = max(((len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS)
                for prefix in prefixes if name == prefix or name.startswith(prefix + ".")),
               default=None)
    if best is None:
        pytest.fail(f"{name} is in no layer: add it to LAYERS and to docs/architecture.md")
    return best[1]


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_every_module_is_in_a_layer():
    for name in import_graph():
        layer_of(name)


def test_no_module_imports_a_higher_layer():
    upward = [f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} "
              f"({LAYERS[layer_of(target)][0]})"
              for name, targets in import_graph().items() for target in sorted(targets)
              if layer_of(target) > layer_of(name)]
    assert not upward, "\n".join(upward)


def side_of(name: str) -> str | None:
    return next((side for side in SIDES if name == side or name.startswith(side + ".")), None)


def test_the_two_sides_of_a_tap_do_not_import_each_other():
    crossing = [f"{name} imports {target}" for name, targets in import_graph().items()
                for target in sorted(targets)
                if side_of(name) and side_of(target) and side_of(name) != side_of(target)]
    assert not crossing, "\n".join(crossing)


def test_the_package_shows_its_sides_as_folders():
    top = {path.name for path in (ROOT / "hostcallback").iterdir()}
    assert {"_trace", "_host", "_records"} <= top
    loose = sorted(name for name in top if name.endswith(".py"))
    assert loose == ["__init__.py", "__main__.py", "_startup.py", "addons.py", "api.py",
                     "config.py", "debug.py", "errors.py", "flavors.py", "jax_callbacks.py",
                     "lifecycle.py", "served_callbacks.py", "serving.py", "tapping.py",
                     "testing.py", "versions.py"]


def test_there_is_no_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_the_check_sees_imports_inside_functions():
    """The check must find what a function-level import hides (one once hid a cycle)."""
    graph = import_graph()
    # binding imports portable in a function
    assert "hostcallback._trace.portable" in graph["hostcallback._trace.binding"]


def test_the_consumers_use_only_the_public_api_and_addons():
    """hostcallback.consumer is written the way a third party's sink would be."""
    allowed = {"hostcallback", "hostcallback.addons", "hostcallback.debug"}
    reached = {f"{name} imports {target}" for name, targets in import_graph().items()
               if name.startswith("hostcallback.consumer")
               for target in targets
               if not target.startswith("hostcallback.consumer") and target not in allowed}
    assert not reached, "\n".join(sorted(reached))


def test_the_compiled_core_imports_no_python_module_of_ours():
    """Constants flow from the core (constants.h) to Python, never back."""
    sources = sorted((ROOT / "hostcallback" / "_native").glob("*.[ch]*"))
    importing = [f"{path.name}: {line.strip()}" for path in sources
                 for line in path.read_text().splitlines()
                 if 'import_("hostcallback' in line.replace(" ", "")]
    assert sources and not importing, "\n".join(importing)


def private_names_used_across_modules(name: str, path: pathlib.Path, known: set[str]) -> list[str]:
    """``from module import _name`` and ``module._name`` where module is another of ours (a
    package's own private submodules, such as the compiled core, are its own)."""
    tree = ast.parse(path.read_text())
    ours: dict[str, str] = {}  # a local name bound to one of our modules
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in known:
            for alias in node.names:
                module = f"{node.module}.{alias.name}"
                if module in known:
                    ours[alias.asname or alias.name] = module
                elif (alias.name.startswith("_") and not alias.name.startswith("__")
                      and node.module != name):
                    used.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    ours[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ours and node.attr.startswith("_")
                and not node.attr.startswith("__") and f"{ours[node.value.id]}.{node.attr}"
                not in known):
            used.append(f"{node.value.id}.{node.attr}")
    return used


def test_no_module_uses_another_modules_private_names():
    """(The seam, hostcallback._jax, reaches into JAX's internals by design: JAX's names, not
    ours, so it is left out here.)"""
    found = modules()
    known = set(found)
    offenders = [f"{name}: {use}" for name, path in found.items()
                 if not name.startswith("hostcallback._jax")
                 for use in private_names_used_across_modules(name, path, known)]
    assert not offenders, "\n".join(offenders)


def test_the_tests_are_laid_out_as_their_readme_says():
    """tests/README.md's table lists exactly the folders of tests/, each once."""
    listed = [line.split("`")[1].rstrip("/") for line in
              (ROOT / "tests" / "README.md").read_text().splitlines()
              if line.startswith("| `")]
    folders = sorted(path.name for path in (ROOT / "tests").iterdir()
                     if path.is_dir() and not path.name.startswith((".", "__")))
    assert sorted(listed) == folders and len(listed) == len(set(listed))
