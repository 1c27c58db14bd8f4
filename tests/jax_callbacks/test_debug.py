"""hostcallback.debug: jax.debug.callback and jax.debug.print's signatures and behaviour, each
case run through JAX's own function and ours on the same input and compared (calls received,
in order, and the text printed)."""

import functools
import inspect
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hostcallback as hcb
from hostcallback import debug as hcb_debug


def plain(value):
    """A received value as plain Python, to compare what both callbacks got."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return (str(np.asarray(value).dtype), np.asarray(value).tolist())
    return value


def wait_for_both():
    jax.effects_barrier()
    hcb_debug.effects_barrier()


def forget_earlier_failures():
    """jax.effects_barrier() raises, once, the error of an earlier test's failed computation."""
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError:
        pass


def calls_of(program, *inputs):
    """Runs ``program(debug_module, record)`` with JAX's jax.debug and with ours; returns what
    each callback received, call by call: (JAX's, ours)."""
    received = {}
    forget_earlier_failures()
    for name, module in (("jax", jax.debug), ("ours", hcb_debug)):
        calls = received[name] = []

        def record(*args, _calls=calls, **kwargs):
            _calls.append(jax.tree.map(plain, (args, kwargs)))

        program(module, record)(*inputs)
        wait_for_both()
    return received["jax"], received["ours"]


def assert_same_calls(program, *inputs, any_order=False):
    theirs, ours = calls_of(program, *inputs)
    if any_order:  # devices call in no fixed order, for JAX as for us
        theirs, ours = sorted(map(repr, theirs)), sorted(map(repr, ours))
    assert ours == theirs
    assert ours  # the case made calls at all


X = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)

# The portable mode leaves hostcallback.debug's callbacks to JAX's own lowering.
needs_serving = pytest.mark.needs_internals("hostcallback.debug served on hostcallback's transport")

# JAX's two-call form (options first) came after JAX 0.8; ours has it on every JAX.
needs_jaxs_two_call_form = pytest.mark.skipif(
    inspect.signature(jax.debug.callback).parameters["callback"].default is not None,
    reason=f"jax {jax.__version__} has no two-call form of its own to compare with")


def test_positional_and_keyword_pytrees_and_static_leaves_reach_the_callback(transport):
    def program(debug, record):
        return jax.jit(lambda x: debug.callback(record, x, {"a": x[0], "b": (x.sum(),)},
                                                "a string", scale=2.0, label="label"))

    assert_same_calls(program, X)


@needs_serving
def test_arrays_arrive_as_jax_arrays_on_the_cpu_as_jaxs_do(transport):
    seen = []
    jax.jit(lambda x: hcb_debug.callback(
        lambda v: seen.append((threading.current_thread().name, v)), x))(X)
    hcb_debug.effects_barrier()
    ((thread, value),) = seen
    assert thread.startswith("hostcallback-receiver")  # served, not JAX's lowering
    assert isinstance(value, jax.Array)
    assert {device.platform for device in value.devices()} == {"cpu"}
    assert repr(value) == repr(X) and str(value) == str(X)
    assert f"{value[0, 1]:.3f}" == f"{X[0, 1]:.3f}"


@needs_jaxs_two_call_form
def test_the_two_call_form_takes_the_options_first(transport):
    def program(debug, record):
        return jax.jit(lambda x: debug.callback(partitioned=False)(record, x, k=x + 1))

    assert_same_calls(program, X)


@needs_jaxs_two_call_form
def test_in_the_two_call_form_keywords_named_like_options_reach_the_callback(transport):
    def program(debug, record):
        return jax.jit(lambda x: debug.callback()(record, x, ordered="yes", partitioned=x[0]))

    assert_same_calls(program, X)


@pytest.mark.parametrize("args", [(), ("only", "static", None)], ids=["none", "static only"])
def test_a_callback_without_arrays_is_called_once(transport, args):
    def program(debug, record):
        return jax.jit(lambda x: (debug.callback(record, *args), x)[1])

    assert_same_calls(program, X)


@needs_serving
def test_under_vmap_each_element_arrives_as_a_jax_array_on_a_receiver_thread(transport):
    seen = []
    jax.jit(jax.vmap(lambda x: hcb_debug.callback(
        lambda v: seen.append((threading.current_thread().name, v)), x)))(X)
    hcb_debug.effects_barrier()
    assert len(seen) == 2
    assert all(thread.startswith("hostcallback-receiver") for thread, _ in seen)  # served
    assert all(isinstance(v, jax.Array) and v.shape == (3,) for _, v in seen)


def test_key_arrays_arrive_as_key_arrays_also_per_batch_element(transport):
    keys = jax.random.split(jax.random.key(0), 3)

    def program(debug, record):
        def f(k):
            debug.callback(lambda key: record(jax.random.key_data(key)), k)
            return k
        return lambda ks: (jax.jit(f)(ks), jax.vmap(f)(ks))

    assert_same_calls(program, keys)


def test_the_callbacks_return_value_is_ignored(transport):
    def program(debug, record):
        return jax.jit(lambda x: debug.callback(lambda v: record(v) or "ignored", x))

    assert_same_calls(program, X)


@pytest.mark.parametrize("in_axes", [0, 1, (0, None)], ids=["axis 0", "axis 1", "unbatched"])
def test_vmap_calls_once_per_batch_element(transport, in_axes):
    def program(debug, record):
        def f(x, y=1.0):
            debug.callback(record, x, y)
            return x
        return jax.vmap(f, in_axes=in_axes) if in_axes != 1 else jax.vmap(f, in_axes=1)

    inputs = (X, jnp.float32(5.0)) if in_axes == (0, None) else (X,)
    assert_same_calls(program, *inputs)


def test_nested_vmap_calls_in_jaxs_order(transport):
    def program(debug, record):
        return jax.vmap(jax.vmap(lambda x: debug.callback(record, x)), in_axes=1)

    assert_same_calls(program, X)


def test_grad_and_jvp_call_with_primal_values_only(transport):
    def program(debug, record):
        def loss(x):
            debug.callback(record, x)
            return jnp.sum(x ** 2)

        return lambda x: (jax.grad(loss)(x), jax.jvp(loss, (x,), (jnp.ones_like(x),)))

    assert_same_calls(program, X)


@pytest.mark.needs_internals("program order inside a computation")
def test_control_flow_calls_each_time_the_code_runs_and_ours_keep_program_order(transport):
    def program(debug, record):
        def f(x):
            x = jax.lax.cond(x.sum() > 0, lambda v: (debug.callback(record, "then", v), v)[1],
                             lambda v: v, x)
            x = jax.lax.fori_loop(0, 3, lambda i, v: (debug.callback(record, i, v), v + 1)[1], x)
            _, ys = jax.lax.scan(lambda c, v: (c, (debug.callback(record, v), v)[1]), 0.0, x)
            return jax.lax.while_loop(lambda v: (debug.callback(record, "w", v), v < 3)[1],
                                      lambda v: v + 1, 0)
        return jax.jit(f)

    theirs, ours = calls_of(program, X)
    # JAX runs unordered callbacks in whatever order XLA schedules them; ours keep the order of
    # the program (the while loop does not depend on the others, and XLA may run it first).
    assert sorted(map(repr, ours)) == sorted(map(repr, theirs))
    labels = [args[0] if isinstance(args[0], str) else type(args[0]).__name__
              for args, _ in ours]
    assert labels == ["then"] + ["tuple"] * 3 + ["tuple"] * 2 + ["w"] * 4


def test_pmap_calls_on_each_device_with_its_slice(transport):
    def program(debug, record):
        return jax.pmap(lambda x: debug.callback(record, x))

    assert_same_calls(program, jnp.arange(8.0).reshape(4, 2), any_order=True)


def test_shard_map_calls_on_each_device_with_its_shard(transport):
    mesh = jax.make_mesh((4,), ("i",))

    def program(debug, record):
        return jax.jit(jax.shard_map(lambda x: (debug.callback(record, x), x)[1], mesh=mesh,
                                     in_specs=P("i"), out_specs=P("i")))

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    assert_same_calls(program, x, any_order=True)


@pytest.mark.needs_internals("taps in a jit over a sharded mesh")
@pytest.mark.parametrize("partitioned", [False, True], ids=["whole value", "partitioned"])
def test_sharded_jit_calls_once_with_the_whole_value_or_per_shard(transport, partitioned):
    mesh = jax.make_mesh((4,), ("i",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))

    def program(debug, record):
        return jax.jit(lambda v: debug.callback(record, v * 2, partitioned=partitioned))

    assert_same_calls(program, x, any_order=True)


def _pjit_on(mesh, program):
    """JAX's own tests' form: pjit under the mesh."""
    from jax.experimental import pjit

    def run(*args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # pjit and `with mesh`
            with mesh:
                return pjit.pjit(program)(*args)
    return run


@pytest.mark.needs_internals("taps in a jit over a sharded mesh")
def test_a_partitioned_print_under_vmap_prints_each_elements_shards_as_jax_does(transport, capsys):
    """JAX's debugging_primitives_test (PartitionedDebugCallbackTest): leaves batched on
    different axes of differently split arrays; each device prints its shard of each element."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    split = NamedSharding(mesh, P("x"))
    x = jax.device_put(np.arange(4).reshape(2, 2), split)
    y = jax.device_put(np.arange(4).reshape(2, 2) + 6, split)

    def program(debug):
        return _pjit_on(mesh, functools.partial(jax.vmap, in_axes=(0, 1))(
            lambda x, y: debug.print("hello: {} {}", x, y, partitioned=True)))

    theirs, ours = printed(capsys, program, x, y)
    assert sorted(ours.splitlines()) == sorted(theirs.splitlines()) == [
        "hello: [0 1] [6]", "hello: [0 1] [8]", "hello: [2 3] [7]", "hello: [2 3] [9]"]


@pytest.mark.needs_internals("taps in a jit over a sharded mesh")
@pytest.mark.parametrize("vmaps", [1, 2])
def test_a_partitioned_print_under_nested_vmaps_prints_what_jax_prints(transport, capsys, vmaps):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2), ("x", "y", "z"))
    arr = jax.device_put(np.arange(24).reshape(2, 3, 4), NamedSharding(mesh, P("x", "y", "z")))

    def program(debug):
        body = functools.partial(debug.print, "hello: {}", partitioned=True)
        for _ in range(vmaps):
            body = jax.vmap(body)
        return _pjit_on(mesh, body)

    theirs, ours = printed(capsys, program, arr)
    assert theirs and sorted(ours.splitlines()) == sorted(theirs.splitlines())


@pytest.mark.needs_internals("ordered=True")
def test_ordered_callbacks_keep_program_order_across_computations(transport):
    def program(debug, record):
        step = jax.jit(lambda x: debug.callback(record, x, ordered=True))
        return lambda x: [step(x + i) for i in range(5)]

    assert_same_calls(program, X)


@needs_serving
def test_a_callback_that_raises_fails_its_computation_as_jaxs_and_the_next_barrier(transport):
    def broken(x):
        raise ValueError("broken callback")

    for debug in (jax.debug, hcb_debug):
        with pytest.raises(jax.errors.JaxRuntimeError, match="broken callback"):
            jax.jit(lambda x, d=debug: (d.callback(broken, x), x + 1)[1])(X).block_until_ready()
    with pytest.raises(hcb.CallbackException, match="broken callback"):  # ours, not JAX's
        hcb_debug.effects_barrier()


@needs_serving
def test_a_failing_callback_of_a_computation_without_results_is_raised_at_the_barrier(
        transport):
    def broken(x):
        raise ValueError("broken callback")

    try:  # the callback transport dispatches as JAX's callbacks do, waiting: it fails here
        jax.jit(lambda x: hcb_debug.callback(broken, x))(X)
    except jax.errors.JaxRuntimeError as error:
        assert transport == "callback" and "broken callback" in str(error)
    with pytest.raises(hcb.CallbackException, match="broken callback"):
        hcb_debug.effects_barrier()


@needs_serving
def test_in_jit_a_callback_lowers_to_our_handler_and_runs_on_a_receiver(transport):
    threads = []
    program = jax.jit(lambda x: hcb_debug.callback(lambda v: threads.append(
        threading.current_thread().name), x))
    text = program.lower(X).as_text()
    assert "xla_ffi_python_cpu_callback" not in text or transport == "callback"
    assert ("hostcallback_tap" in text) == (transport == "native")
    program(X)
    hcb_debug.effects_barrier()
    assert threads and all(name.startswith("hostcallback-receiver") for name in threads)


def test_a_callback_that_is_not_callable_is_refused_as_jax_refuses_it():
    for module in (jax.debug, hcb_debug):
        with pytest.raises(TypeError, match="first argument to jax.debug.callback must be "
                                            "callable"):
            module.callback(3, X)


# ---- print -----------------------------------------------------------------------------------


def printed(capsys, program, *inputs):
    """What ``program(debug_module)`` prints with JAX's jax.debug and with ours."""
    out = {}
    forget_earlier_failures()
    for name, module in (("jax", jax.debug), ("ours", hcb_debug)):
        capsys.readouterr()
        program(module)(*inputs)
        wait_for_both()
        out[name] = capsys.readouterr().out
    return out["jax"], out["ours"]


@pytest.mark.parametrize("fmt,args,kwargs", [
    ("x: {}", (X,), {}),
    ("{0} and {0}", (X[0],), {}),
    ("{x:.3f} {y}", (), {"x": X[0, 1], "y": X}),
    ("{} {a[0]} {a[1][b]}", (X[1],), {"a": (X[0, 0], {"b": X[1, 2]})}),
    ("tuple {}", ((X[0], X[1, 0]),), {}),
    ("no fields", (), {}),
], ids=["auto", "index", "names and specs", "indexing into pytrees", "containers", "no fields"])
def test_print_writes_what_jax_debug_print_writes(transport, capsys, fmt, args, kwargs):
    def program(debug):
        return jax.jit(lambda a, k: debug.print(fmt, *a, **k))

    theirs, ours = printed(capsys, program, args, kwargs)
    assert ours == theirs and ours


def test_print_uses_the_numpy_print_options_of_where_it_was_traced(transport, capsys):
    def program(debug):
        with np.printoptions(precision=2):
            return jax.jit(lambda x: debug.print("{}", x / 3)).lower(X).compile()

    theirs, ours = printed(capsys, program, X)
    assert ours == theirs and "0.33" in ours


def test_print_without_fields_writes_the_values_after_the_text(transport, capsys):
    def program(debug):
        return jax.jit(lambda x: debug.print("values:", x, x[0], skip_format_check=True))

    theirs, ours = printed(capsys, program, X)
    assert ours == theirs and ours.startswith("values: [[0. 1. 2.]")


def test_print_under_vmap_prints_each_element(transport, capsys):
    def program(debug):
        return jax.vmap(lambda x: debug.print("row {}", x))

    theirs, ours = printed(capsys, program, X)
    assert ours == theirs and ours.count("row") == 2


@needs_jaxs_two_call_form
def test_print_two_call_form(transport, capsys):
    def program(debug):
        return jax.jit(lambda x: debug.print(partitioned=False)("x={x}", x=x))

    theirs, ours = printed(capsys, program, X)
    assert ours == theirs and ours.startswith("x=[[0. 1. 2.]")


@pytest.mark.parametrize("fmt,args,kwargs,message", [
    ("{}", (1.0, 2.0), {}, "Unused positional arguments to `jax.debug.print`"),
    ("{x}", (), {"x": 1.0, "y": 2.0}, "Unused keyword arguments to `jax.debug.print`"),
    ("{} {}", (1.0,), {}, "index"),
    ("{x}", (), {}, "'x'"),
])
def test_print_refuses_what_jax_refuses_with_the_same_error(fmt, args, kwargs, message):
    errors = []
    for module in (jax.debug, hcb_debug):
        with pytest.raises(Exception, match=message) as raised:
            jax.jit(functools.partial(module.print, fmt, **kwargs))(*args)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]


def test_a_format_string_that_cannot_be_parsed_is_refused_at_trace_time_without_the_check():
    """skip_format_check leaves out the fields' check, not the parse that decides whether the
    string is formatted (JAX parses it at trace time too)."""
    with pytest.raises(ValueError, match="Single '{'"):
        jax.jit(lambda x: hcb.debug.print("{", x, skip_format_check=True))(1.0)
