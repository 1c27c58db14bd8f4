"""id_print: a first line of sorted metadata, then the value, written on the host."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from hostcallback._host import printing


def test_prints_sorted_metadata_then_the_value(transport):
    out = io.StringIO()
    jax.jit(lambda x: hcb.id_print(x, what="loss", step=3, output_stream=out))(jnp.float32(1.5))
    hcb.barrier_wait()
    assert out.getvalue() == "step: 3 what: loss\n1.5\n"


def test_prints_tuples_lists_and_dicts_in_the_legacy_layout():
    value = ({"b": np.int32(2), "a": np.float32(1)}, [np.int8(3)])
    assert printing.format_value(value) == "( { a=1.0 b=2 } [ 3 ] )"


def test_threshold_summarises_large_arrays(transport):
    out = io.StringIO()
    jax.jit(lambda x: hcb.id_print(x, output_stream=out, threshold=4))(jnp.arange(100))
    hcb.barrier_wait()
    assert "..." in out.getvalue()


def test_prints_the_device_when_asked(transport):
    out = io.StringIO()
    jax.jit(lambda x: hcb.id_print(x, tap_with_device=True, output_stream=out))(jnp.int32(4))
    hcb.barrier_wait()
    assert out.getvalue() == f"device: {jax.devices()[0]}\n4\n"


@pytest.mark.needs_internals("transforms in tap functions")
def test_prints_transforms_when_there_are_some(transport):
    out = io.StringIO()
    jax.vmap(lambda x: hcb.id_print(x, output_stream=out))(jnp.arange(2))
    hcb.barrier_wait()
    assert out.getvalue() == "transforms: [('batch', {'batch_dims': (0,)})]\n[0 1]\n"


def test_without_metadata_only_the_value_is_printed(transport, capsys):
    jax.jit(lambda x: hcb.id_print(x))(jnp.int32(7))
    hcb.barrier_wait()
    assert capsys.readouterr().out == "7\n"


def test_id_print_returns_its_argument_or_result(transport):
    out = io.StringIO()
    f = jax.jit(lambda x: (hcb.id_print(x, output_stream=out),
                           hcb.id_print(x, result=x + 1, output_stream=out)))
    assert f(jnp.int32(1)) == (1, 2)
