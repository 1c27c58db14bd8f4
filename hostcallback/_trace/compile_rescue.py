"""A computation that XLA's CPU compiler refuses for a known bug of its own is compiled once more
without the pass that has it.

From JAX 0.10 on (0.10.2 to 0.12.0.1 seen), XLA's CPU compiler fuses reductions into YNNPACK
library calls, and that pass fails ("... is live and cannot be removed") where a reduction's
only use is a callback and its operand is the computation's one result: ``y = f(x);
id_print(jnp.mean(y)); return y`` for a 2-D ``y``, and the same with JAX's own
``jax.debug.callback``. Such a module is compiled again without YNNPACK's fusions; every other
computation keeps them. Said once on the "hostcallback" logger.
"""

from __future__ import annotations

import logging

from hostcallback._jax import patches

logger = logging.getLogger("hostcallback")

_XLA_LIVE_INSTRUCTION_REMOVED = "is live and cannot be removed"
_WITHOUT_YNN_FUSIONS = [("xla_cpu_experimental_ynn_fusion_type", "")]
_said = False


def _rescue(error: Exception, platform: str) -> list[tuple[str, str]] | None:
    global _said
    if platform != "cpu" or _XLA_LIVE_INSTRUCTION_REMOVED not in str(error):
        return None
    if not _said:
        _said = True
        logger.warning(
            "XLA's CPU compiler failed on a computation (%s): a known XLA bug in its YNNPACK "
            "fusions, where a callback takes a reduction of the computation's result. "
            "hostcallback compiled it again without those fusions, which other computations "
            "keep.", str(error).splitlines()[0][:200])
    return _WITHOUT_YNN_FUSIONS


def install() -> None:
    """Compiles such computations again from now on (once, however often it is called)."""
    patches.compile_again_when(_rescue)
