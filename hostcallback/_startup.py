"""Imported at interpreter start, through the installed ``hostcallback_jax_callbacks.pth``, when
``HOSTCALLBACK_JAX_CALLBACKS`` is set: turns the switch on (serving.py) for a program that never
imports hostcallback, right after the program imports jax. Not before: at that point of start-up
jax may not be importable yet (a venv that sees the system's packages adds them later), and a
program that never uses jax pays nothing. A failure says why on stderr and leaves JAX's own
lowering; it never stops the program."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def _hostcallback_importing() -> bool:
    """Whether a module of hostcallback is being imported now (it imported jax)."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items())
               if name == "hostcallback" or name.startswith("hostcallback."))


def _serve_now_or_at_next_lowering() -> None:
    if not _hostcallback_importing():
        _serve()
        return
    # Serving now would import hostcallback's modules half-way through their own import: it
    # waits for the next lowering, by when they are all there.
    from hostcallback import config

    config.at_next_lowering.append(_serve)


def _serve() -> None:
    try:
        from hostcallback.serving import serve_jax_callbacks

        serve_jax_callbacks()
    except Exception as error:  # noqa: BLE001 - whatever it is, the program must go on
        print(f"hostcallback: HOSTCALLBACK_JAX_CALLBACKS is set, but JAX's callbacks keep JAX's "
              f"own lowering: {type(error).__name__}: {error}", file=sys.stderr)


class _ServeOnceJaxIsImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the import of jax to the other finders and has the switch
    turned on once jax's module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def run_then_serve(module) -> None:
            run_module(module)
            _serve_now_or_at_next_lowering()

        spec.loader.exec_module = run_then_serve
        return spec


if "jax" in sys.modules:
    _serve_now_or_at_next_lowering()
else:
    sys.meta_path.insert(0, _ServeOnceJaxIsImported())
