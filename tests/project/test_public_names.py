"""The package's public names are listed three times in hostcallback/__init__.py (``__all__``,
the names imported on first use, and the imports for type checkers): the three agree, and each
name resolves to what the module that defines it holds."""

import ast
import importlib
import inspect

import pytest

import hostcallback

INIT = inspect.getsource(hostcallback)


def type_checking_imports() -> dict[str, str]:
    """What the ``if TYPE_CHECKING:`` block imports: name -> module."""
    (block,) = [node for node in ast.parse(INIT).body if isinstance(node, ast.If)
                and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    return {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}


def imported_at_once() -> set[str]:
    """The public names __init__.py binds itself (no jax needed for them)."""
    return {name for name in hostcallback.__all__ if name in vars(hostcallback)
            and name not in hostcallback._IMPORTED_ON_FIRST_USE}


def test_all_lists_exactly_the_names_imported_on_first_use_and_at_once():
    assert set(hostcallback.__all__) == (set(hostcallback._IMPORTED_ON_FIRST_USE)
                                         | imported_at_once())
    assert len(hostcallback.__all__) == len(set(hostcallback.__all__))


def test_type_checkers_see_each_name_imported_on_first_use_from_its_module():
    on_first_use = {name: module for name, module in hostcallback._IMPORTED_ON_FIRST_USE.items()
                    if name not in hostcallback._SUBMODULES}
    assert type_checking_imports() == on_first_use


@pytest.mark.parametrize("name", sorted(hostcallback.__all__))
def test_each_public_name_resolves_to_its_definition(name):
    value = getattr(hostcallback, name)
    module = hostcallback._IMPORTED_ON_FIRST_USE.get(name)
    if name in hostcallback._SUBMODULES:
        assert value is importlib.import_module(f"hostcallback.{name}")
    elif module:
        assert value is getattr(importlib.import_module(module), name)
    assert name in dir(hostcallback)
