"""The hand-written stubs of the compiled modules (the core's _hostcallback_outfeed.pyi, the
consumers' _frames.pyi) say what the built modules have: the same functions with the same
parameters, the same constants, and the same keys in the dicts of statistics."""

import ast
import inspect
import re
from pathlib import Path

import pytest

from hostcallback._native import outfeed
from hostcallback.consumer.native_frames import frames

ROOT = Path(__file__).resolve().parents[2]
STUBS = {"core": (ROOT / "hostcallback" / "_native" / "_hostcallback_outfeed.pyi", outfeed),
         "frames": (ROOT / "consumer" / "_frames.pyi", frames)}


def tree_of(module: str) -> ast.Module:
    return ast.parse(STUBS[module][0].read_text())


def stub_functions(module: str = "core") -> dict[str, list[str]]:
    return {node.name: [a.arg for a in (*node.args.posonlyargs, *node.args.args,
                                        *node.args.kwonlyargs)]
            for node in tree_of(module).body if isinstance(node, ast.FunctionDef)}


def stub_constants(module: str) -> set[str]:
    return {node.target.id for node in tree_of(module).body
            if isinstance(node, ast.AnnAssign) and not node.target.id.startswith("_")}


def stub_dict_keys(name: str) -> set[str]:
    (typed_dict,) = [node for node in tree_of("core").body
                     if isinstance(node, ast.ClassDef) and node.name == name]
    return {node.target.id for node in typed_dict.body if isinstance(node, ast.AnnAssign)}


def built_parameters(function) -> list[str]:
    """The parameter names of a nanobind function, from the signature it reports: the text
    before each ':' at the top level of its parentheses."""
    (signature, *_), *_ = function.__nb_signature__
    params = re.match(r"def \w+\((.*)\) ->", signature).group(1)
    names, depth, start = [], 0, 0
    for index, char in enumerate(params + ","):
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "," and depth == 0:
            name = params[start:index].split(":")[0].strip().lstrip("*")
            if name and name not in ("*", "/"):
                names.append(name)
            start = index + 1
    return names


@pytest.mark.parametrize("module", sorted(STUBS))
def test_the_stub_names_every_function_of_the_module_and_no_other(module):
    built = {name for name, value in vars(STUBS[module][1]).items()
             if not name.startswith("_") and callable(value) and not inspect.isclass(value)}
    assert set(stub_functions(module)) == built


@pytest.mark.parametrize(("module", "name"), [(module, name) for module in sorted(STUBS)
                                              for name in sorted(stub_functions(module))])
def test_each_function_takes_the_parameters_the_stub_says(module, name):
    assert stub_functions(module)[name] == built_parameters(getattr(STUBS[module][1], name))


@pytest.mark.parametrize("module", sorted(STUBS))
def test_the_stub_names_every_constant_of_the_module_and_no_other(module):
    built = {name for name, value in vars(STUBS[module][1]).items()
             if not name.startswith("_") and not callable(value)
             and not inspect.ismodule(value)}
    assert stub_constants(module) == built


def test_the_statistics_have_the_keys_the_stub_says():
    device = 91  # a queue of its own
    assert set(outfeed.stats(device, platform="test")) == stub_dict_keys("_QueueStats")
    assert set(outfeed.computations(device, platform="test")) == stub_dict_keys("_Computations")
    assert set(outfeed.pool_stats()) == stub_dict_keys("_PoolStats")
    assert set(outfeed.pinned_stats()) == stub_dict_keys("_PinnedStats")
