"""Taps reach the host in program order by default, per device, across every construct.

Each test records (tag, value) pairs and checks their exact order, on both transports. The last
tests check that this order costs no dispatch: the compiled computation has no JAX effect.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from helpers import run_python
from hostcallback import config


class Tags:
    """Tap functions that record (tag, value[, device id]) in one list, in arrival order."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def __call__(self, name: str, *, with_device: bool = False):
        def tap(arg, transforms, device=None):
            value = np.asarray(arg).tolist()
            self.seen.append((name, value) if device is None else (name, value, device.id))
        tap.__name__ = name
        return functools.partial(hcb.id_tap, tap, tap_with_device=with_device)

    def on(self, device_id: int) -> list[tuple]:
        return [(name, value) for name, value, device in self.seen if device == device_id]


@pytest.fixture
def tags(transport):
    yield Tags()
    hcb.barrier_wait()


def run(f, *args):
    out = jax.jit(f)(*args)
    hcb.barrier_wait()
    return out


def test_a_bar_defined_in_one_cond_is_updated_in_another(tags):
    """The progress-bar pattern: cond 1 creates a bar at step 0, cond 2 updates it every 2 steps."""
    define, update = tags("define"), tags("update")

    def body(i, carry):
        created = lax.cond(i == 0, lambda: define(None, result=i), lambda: i)
        updated = lax.cond(i % 2 == 0, lambda: update(2, result=i), lambda: i)
        return carry + created + updated

    run(lambda: lax.fori_loop(0, 6, body, 0))
    assert tags.seen == [("define", None), ("update", 2), ("update", 2), ("update", 2)]


def test_taps_in_two_sequential_loops(tags):
    first, second = tags("first"), tags("second")

    def f(x):
        x = lax.fori_loop(0, 3, lambda i, c: first(c + i), x)
        return lax.fori_loop(0, 3, lambda i, c: second(c + i), x)

    run(f, 0)
    assert tags.seen == [("first", 0), ("first", 1), ("first", 3),
                         ("second", 3), ("second", 4), ("second", 6)]


def test_taps_before_inside_and_after_a_while_loop(tags):
    before, predicate, body, after = tags("before"), tags("pred"), tags("body"), tags("after")

    def f(x):
        before(x)
        y = lax.while_loop(lambda c: predicate(c) < 2, lambda c: body(c + 1), x)
        after(y)
        return y

    run(f, 0)
    assert tags.seen == [("before", 0), ("pred", 0), ("body", 1), ("pred", 1), ("body", 2),
                         ("pred", 2), ("after", 2)]


def test_nested_conds_in_a_scan(tags):
    outer, inner, plain = tags("outer"), tags("inner"), tags("plain")

    def step(carry, x):
        def big(x):
            outer(x)
            return lax.cond(x > 2, lambda: inner(x * 10), lambda: x)
        y = lax.cond(x > 1, big, lambda x: x, x)
        plain(y)
        return carry, y

    run(lambda xs: lax.scan(step, 0, xs), jnp.arange(4))
    assert tags.seen == [("plain", 0), ("plain", 1), ("outer", 2), ("plain", 2),
                         ("outer", 3), ("inner", 30), ("plain", 30)]


@pytest.mark.needs_internals("program order inside a computation")
def test_switch_nested_jit_and_custom_rules_keep_order(tags):
    a, b, c, d, e = (tags(name) for name in "abcde")

    @jax.custom_jvp
    def smooth(x):
        return c(x)

    smooth.defjvp(lambda primals, tangents: (smooth(*primals), tangents[0]))

    @jax.custom_vjp
    def clipped(x):
        return d(x)

    clipped.defvjp(lambda x: (clipped(x), None), lambda _, g: (g,))

    def f(x):
        x = lax.switch(1, [lambda x: x, lambda x: a(x + 1), lambda x: x], x)
        x = jax.jit(lambda x: b(x * 2))(x)
        x = jax.checkpoint(lambda x: e(smooth(clipped(x)) + 1))(x)
        return x

    run(f, 1.0)
    assert tags.seen == [("a", 2.0), ("b", 4.0), ("d", 4.0), ("c", 4.0), ("e", 5.0)]


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_order_holds_under_vmap_and_grad(tags):
    inside, outside = tags("inside"), tags("outside")

    def f(x):
        y = lax.fori_loop(0, 2, lambda i, c: lax.cond(i == 1, lambda: inside(c * 2),
                                                      lambda: c), x)
        return outside(y).sum()

    run(jax.vmap(f), jnp.array([1.0, 2.0]))
    run(jax.grad(f), 3.0)
    assert tags.seen == [("inside", [2.0, 4.0]), ("outside", [2.0, 4.0]),
                         ("inside", 6.0), ("outside", 6.0)]


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_a_vmapped_while_whose_predicate_taps_keeps_finished_lanes(tags):
    predicate = tags("pred")
    out = run(jax.vmap(lambda n: lax.while_loop(lambda n: predicate(n) > 0, lambda n: n - 1, n)),
              jnp.array([1, 2]))
    np.testing.assert_array_equal(out, [0, 0])
    assert tags.seen == [("pred", [1, 2]), ("pred", [0, 1]), ("pred", [0, 0])]


def test_many_independent_taps_in_one_block_arrive_in_order(tags):
    """XLA reorders independent side effects unless something orders them."""
    def f(x):
        for i in range(60):
            tags(f"t{i}")(x + i)
        lax.cond(x == 0, lambda: [tags(f"c{i}")(x + i) for i in range(60)] and None, lambda: None)
        return x

    run(f, 0)
    assert tags.seen == ([(f"t{i}", i) for i in range(60)] + [(f"c{i}", i) for i in range(60)])


@pytest.mark.needs_internals("taps in a jit over a sharded mesh", transport="native")
@pytest.mark.needs_internals("the device of callback-transport records", transport="callback")
def test_each_device_keeps_program_order_under_pmap_shard_map_and_sharded_jit(tags):
    first, second = tags("first", with_device=True), tags("second", with_device=True)

    def per_device(x):
        x = lax.fori_loop(0, 2, lambda i, c: lax.cond(i >= 0, lambda: first(c + i),
                                                      lambda: c), x)
        return lax.cond(x.sum() >= 0, lambda: second(x * 10), lambda: x)

    jax.pmap(per_device)(jnp.arange(4.0))
    mesh = jax.make_mesh((4,), ("d",))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("d")))
        jax.jit(jax.shard_map(per_device, in_specs=P("d"), out_specs=P("d")))(x)
        jax.jit(per_device)(x)  # a sharded jit: whole values, from device 0
    hcb.barrier_wait()
    for device in range(4):
        mine = [(f, float(np.sum(v))) for f, v in tags.on(device)]
        per_step = [("first", device + 0.0), ("first", device + 1.0),
                    ("second", device * 10 + 10.0)]
        whole = [("first", 6.0), ("first", 10.0), ("second", 100.0)] if device == 0 else []
        assert mine == per_step * 2 + whole


@pytest.mark.needs_internals("program order inside a computation")
def test_each_tap_takes_the_token_the_tap_before_it_returned_in_the_lowered_program():
    """What makes the order hold, checked where XLA cannot reorder by chance: one token is made
    for the whole computation, and no two taps take the same token (each takes the one the tap,
    loop or branch before it returned)."""
    def f(x):
        for i in range(20):
            hcb.id_tap(lambda a, t: None, x + i)

        def body(i, c):
            hcb.id_tap(lambda a, t: None, c)
            hcb.id_tap(lambda a, t: None, c + 1)
            return c

        x = lax.fori_loop(0, 3, body, x)
        lax.cond(x > 0, lambda: (hcb.id_tap(lambda a, t: None, x),
                                 hcb.id_tap(lambda a, t: None, x + 1), None)[-1], lambda: None)
        return x

    with config.override(transport="native"):
        text = jax.jit(f).lower(1.0).as_text()
    assert text.count("stablehlo.create_token") == 1
    tokens_taken = 0
    for function in text.split("func.func")[1:]:
        taken = re.findall(r"custom_call @hostcallback_tap\((%[\w#]+)", function)
        assert len(taken) == len(set(taken)), f"two taps share a token: {taken}"
        tokens_taken += len(taken)
    assert tokens_taken == 24


@pytest.mark.needs_internals("program order inside a computation, and JAX's fast dispatch for "
                             "computations that hold a tap")
def test_program_order_costs_no_jax_effect_in_the_compiled_computation(transport):
    """The compiled step stays on JAX's fast dispatch path: no ordered or unordered effect."""
    f = jax.jit(lambda x: lax.cond(x > 1e9, lambda: hcb.id_tap(print, x, result=x),
                                   lambda: x) + 1)
    unsafe_call = f.lower(1.0).compile()._executable.unsafe_call
    assert unsafe_call.ordered_effects == [] and not unsafe_call.has_unordered_effects
    assert "HostcallbackProgramOrder" in str(jax.make_jaxpr(f)(1.0).effects)


@pytest.mark.needs_internals("ordered=True")
def test_ordered_true_still_orders_across_computations(transport):
    f = jax.jit(lambda x: hcb.id_tap(print, x, ordered=True))
    assert f.lower(1.0).compile()._executable.unsafe_call.ordered_effects != []


@pytest.mark.needs_internals("program order inside a computation")
def test_taps_keep_their_order_with_jax_simplified_jaxpr_constants():
    # That JAX flag counts a computation's constants twice; a repeated one once broke lowering.
    result = run_python("""
        import jax, jax.numpy as jnp, numpy as np
        import hostcallback as hcb
        c = np.arange(1000.0, dtype=np.float32)
        try:  # JAX 0.8 itself fails with that flag on this program, taps or not
            jax.jit(lambda x: jnp.asarray(c) + x)(jnp.float32(1))
        except AttributeError as error:
            print(f"jax itself fails: {error}")
            raise SystemExit(0)
        seen = []
        tap = lambda name: (lambda a, t: seen.append((name, float(np.asarray(a).sum()))))
        def f(x):
            y = hcb.id_tap(tap("first"), x + c)
            hcb.id_tap(tap("second"), jnp.asarray(c))
            return y
        out = jax.jit(f)(jnp.float32(1))
        hcb.barrier_wait()
        print(float(out[2]), [name for name, _ in seen])
        """, env={"JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS": "1"}, devices=1)
    assert result.returncode == 0, result.stderr[-2000:]
    if result.stdout.startswith("jax itself fails"):
        pytest.skip(f"this JAX cannot run the program with the flag at all ({result.stdout})")
    assert result.stdout.split("\n")[-2] == "3.0 ['first', 'second']"
