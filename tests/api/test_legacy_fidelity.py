"""Legacy host_callback programs and the jax.pure_callback reference examples run unchanged
(issue 11): result canonicalisation, legacy wording, id_print's output, trace-time checks."""

import io
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hostcallback as hcb
from hostcallback import _jax
from hostcallback._host import printing

# ---- pure_callback and call: the result dtypes legacy and JAX accept -----------------------


@pytest.mark.needs_internals("vmap methods of calls other than sequential")
@pytest.mark.parametrize("vmap_method", ["expand_dims", "broadcast_all"])
def test_pure_callback_reference_vmap_example_casts_numpy_float64_to_the_declared_float32(
        transport, vmap_method):
    def callback(x, y):
        return x + y  # numpy: int32 + float32 -> float64

    def fun(x, y, **kwargs):
        shape_dtype = jax.ShapeDtypeStruct(x.shape, jnp.result_type(x, y))
        return hcb.pure_callback(callback, shape_dtype, x, y, **kwargs)

    out = jax.vmap(partial(fun, vmap_method=vmap_method), in_axes=(0, None))(jnp.arange(4), 1.0)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize("returned,declared", [
    (np.float64, jnp.float32), (np.int64, jnp.int32), (np.complex128, jnp.complex64),
    (np.uint64, jnp.uint32)])
def test_call_accepts_numpy_defaults_that_canonicalise_to_the_declared_dtype(
        transport, returned, declared):
    f = jax.jit(lambda x: hcb.call(lambda v: np.arange(3).astype(returned), x,
                                   result_shape=jax.ShapeDtypeStruct((3,), declared)))
    out = f(1.0)
    assert out.dtype == declared
    np.testing.assert_array_equal(out, [0, 1, 2])


def test_legacy_zeros_example_runs(transport):
    out = jax.jit(lambda x: hcb.call(lambda x: np.zeros(3), x,
                                     result_shape=jax.ShapeDtypeStruct((3,), jnp.float32)))(1.0)
    np.testing.assert_array_equal(out, np.zeros(3, np.float32))


@pytest.mark.parametrize("returned,declared", [
    (np.float32, jnp.int32), (np.float64, jnp.int32), (np.int8, jnp.int32),
    (np.float16, jnp.float32)])
def test_call_refuses_dtypes_that_are_not_a_canonicalisation_of_the_declared_one(
        transport, returned, declared):
    f = jax.jit(lambda x: hcb.call(lambda v: np.zeros(3, returned), x,
                                   result_shape=jax.ShapeDtypeStruct((3,), declared)))
    with pytest.raises(Exception, match=f"returned {np.dtype(returned)}\\[3\\] for result leaf 0"):
        f(1.0).block_until_ready()
    hcb.barrier_wait()  # a failed call is reported once, where it failed (issue 11 item 4)


def test_a_canonicalisable_dtype_with_the_wrong_shape_is_still_refused(transport):
    f = jax.jit(lambda x: hcb.call(lambda v: np.zeros(2), x,
                                   result_shape=jax.ShapeDtypeStruct((3,), jnp.float32)))
    with pytest.raises(Exception, match=r"returned float64\[2\] .* says float32\[3\]"):
        f(1.0).block_until_ready()
    hcb.barrier_wait()  # a failed call is reported once, where it failed (issue 11 item 4)


# ---- legacy wording -----------------------------------------------------------------------


def test_barrier_exception_begins_with_the_legacy_phrase(transport):
    def broken(x, transforms):
        raise ValueError("Some user message")

    jax.jit(lambda x: hcb.id_tap(broken, x))(1.0)
    with pytest.raises(hcb.CallbackException,
                       match=r"^There were exceptions during callback processing\. .*"
                             r"Some user message"):
        hcb.barrier_wait()


def test_barrier_exception_names_the_last_error_as_legacy_did_then_the_count_and_the_first(
        transport):
    def broken(x, transforms):
        raise ValueError(f"failure {int(x)}")

    for step in range(3):
        jax.jit(lambda x: hcb.id_tap(broken, x))(float(step))
    with pytest.raises(hcb.CallbackException) as raised:
        hcb.barrier_wait()
    message = str(raised.value)
    assert message.startswith("There were exceptions during callback processing. Last one was: ")
    assert "ValueError: failure 2. 3 tap consumer call(s) raised" in message
    assert message.endswith("ValueError: failure 0")  # the first, which is also the __cause__
    assert str(raised.value.__cause__) == "failure 0"


def test_id_tap_kwargs_error_has_the_legacy_wording():
    with pytest.raises(TypeError, match=r"^Support for \*\*kwargs in ``id_tap`` has been removed"
                                        r".*functools\.partial"):
        hcb.id_tap(lambda a, t: None, 1.0, what="loss")


@pytest.mark.parametrize("result_shape", ["string", lambda x: x])
def test_bad_result_shape_has_the_legacy_wording(result_shape):
    with pytest.raises(ValueError, match="The values must be either numeric scalars, or must "
                                         "have 'shape' and 'dtype' attributes"):
        hcb.call(lambda x: x, 3.0, result_shape=result_shape)


# ---- id_print ------------------------------------------------------------------------------


def test_transforms_without_parameters_print_as_their_bare_name():
    transforms = (("jvp", {}), ("transpose",), ("batch", {"batch_dims": (0,)}))
    assert printing.format_metadata({}, transforms) == (
        "transforms: ['jvp', 'transpose', ('batch', {'batch_dims': (0,)})]")


@pytest.mark.needs_internals("taps of tangents or cotangents")
def test_id_print_on_cotangents_prints_transpose_as_legacy(transport):
    out = io.StringIO()

    @jax.custom_jvp
    def f(x):
        return x

    @f.defjvp
    def f_jvp(primals, tangents):
        return primals[0], hcb.id_print(tangents[0], output_stream=out)

    jax.grad(f)(1.0)
    hcb.barrier_wait()
    assert out.getvalue() == "transforms: ['transpose']\n1.\n"


def test_id_print_with_a_format_string_prints_one_formatted_line(transport):
    out = io.StringIO()

    @jax.jit
    def step(step, loss):
        hcb.id_print("step {step}: loss {loss:.4f}", step=step, loss=loss, output_stream=out)
        return loss

    step(jnp.int32(3), jnp.float32(0.25))
    hcb.barrier_wait()
    assert out.getvalue() == "step 3: loss 0.2500\n"


def test_id_print_format_string_takes_positional_values_too(transport):
    out = io.StringIO()
    jax.jit(lambda x, y: hcb.id_print("x={} y={}", x, y, output_stream=out))(1, 2.5)
    hcb.barrier_wait()
    assert out.getvalue() == "x=1 y=2.5\n"


def test_id_print_legacy_form_keeps_its_legacy_output(transport):
    out = io.StringIO()
    jax.jit(lambda x: hcb.id_print(x, what="loss", output_stream=out))(jnp.float32(1.5))
    hcb.barrier_wait()
    assert out.getvalue() == "what: loss\n1.5\n"


def test_a_format_field_without_a_value_is_refused_at_trace_time():
    with pytest.raises(ValueError, match=r"field \{loss\} but no keyword argument loss="):
        hcb.id_print("loss {loss:.4f}", step=1)
    with pytest.raises(ValueError, match=r"only 1 positional value"):
        hcb.id_print("{} {}", 1)


def test_a_field_inside_a_format_spec_without_a_value_is_refused_at_trace_time():
    with pytest.raises(ValueError, match=r"field \{width\} but no keyword argument width="):
        hcb.id_print("loss {loss:{width}}", loss=1.0)


def test_a_format_string_mixing_numbered_and_automatic_fields_is_refused_at_trace_time():
    with pytest.raises(ValueError, match=r"not a valid format string: cannot switch"):
        hcb.id_print("{0} {}", 1, 2)
    with pytest.raises(ValueError, match=r"not a valid format string: Single '\}'"):
        hcb.id_print("x}", 1)


def test_automatic_fields_with_an_attribute_or_an_index_are_formatted(transport):
    """``{.real}`` and ``{[0]}`` are the next positional value's attribute and item, as
    ``str.format`` reads them."""
    out = io.StringIO()
    jax.jit(lambda x, y: hcb.id_print("{.real} {[1]}", x, y, output_stream=out))(
        jnp.complex64(1.5 + 2j), jnp.arange(3))
    hcb.barrier_wait()
    assert out.getvalue() == "1.5 1\n"


def test_a_format_field_may_name_an_attribute_of_the_host_array(transport):
    """id_print checks only a field's leading name at trace time: the attribute is the host
    array's, which a tracer need not have."""
    out = io.StringIO()
    jax.jit(lambda x: hcb.id_print("{x.flags.writeable}", x=x, output_stream=out))(1.0)
    hcb.barrier_wait()
    assert out.getvalue() == "False\n"


# ---- tap and call functions of the wrong arity --------------------------------------------


def test_a_one_argument_tap_function_is_refused_at_trace_time_with_the_right_form():
    with pytest.raises(TypeError, match=r"id_tap\(\) will call tap_func\(arg, transforms\).*"
                                        r"def tap_func\(arg, transforms\)"):
        jax.jit(lambda x: hcb.id_tap(lambda x: print(x), x))(1.0)


def test_a_tap_function_without_device_is_refused_when_tap_with_device_is_set():
    def tap(arg, transforms):
        pass

    with pytest.raises(TypeError, match=r"tap_func\(arg, transforms, device=d\)"):
        hcb.id_tap(tap, 1.0, tap_with_device=True)


def test_a_two_argument_call_function_is_refused_at_trace_time():
    with pytest.raises(TypeError, match=r"call\(\) will call callback_func\(arg\)"):
        hcb.call(lambda x, y: x, (1.0, 2.0), result_shape=jax.ShapeDtypeStruct((), jnp.float32))


def test_pure_callback_checks_its_callback_against_the_arguments_given():
    with pytest.raises(TypeError, match=r"with 2 argument\(s\)"):
        hcb.pure_callback(lambda x: x, jax.ShapeDtypeStruct((), jnp.float32), 1.0, 2.0)


def test_functions_with_defaults_varargs_or_no_signature_are_accepted(transport):
    seen = []
    hcb.id_tap(lambda *args: seen.append(len(args)), 1.0)
    hcb.id_tap(lambda arg, transforms=(), extra=None: seen.append(2), 1.0)
    out = hcb.call(np.negative, np.float32(2.0),  # a ufunc: no signature to check
                   result_shape=jax.ShapeDtypeStruct((), jnp.float32))
    hcb.barrier_wait()
    assert seen == [2, 2] and out == -2.0


# ---- eager calls ---------------------------------------------------------------------------


def _count_compilations(fn):
    compiled = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return result, len(compiled)


def test_an_eager_call_on_numpy_arguments_compiles_one_computation(transport):
    hcb.barrier_wait()  # the receivers and their barrier markers are compiled already
    shape = jax.ShapeDtypeStruct((5,), jnp.float32)
    out, compilations = _count_compilations(
        lambda: hcb.call(lambda x: x * 2, np.arange(5.0, dtype=np.float32), result_shape=shape))
    np.testing.assert_array_equal(out, np.arange(5.0) * 2)
    assert compilations == 1


def test_an_eager_tap_on_a_python_number_compiles_one_computation_and_keeps_weak_type(
        transport, collector):
    hcb.barrier_wait()
    out, compilations = _count_compilations(lambda: hcb.id_tap(collector, 2.5))
    # The portable mode's callback transport taps eagerly through jax.debug.callback, which
    # runs on the host at once and compiles nothing.
    assert compilations == (0 if _jax.PORTABLE and transport == "callback" else 1)
    assert out.dtype == jnp.float32 and out.weak_type
    hcb.barrier_wait()
    assert collector.values == [2.5]


# ---- PRNG keys -----------------------------------------------------------------------------


def test_a_typed_key_can_be_tapped_inside_jit_with_result_key_as_in_jax_issue_13949(
        transport, collector):
    @jax.jit
    def f(key):
        key = hcb.id_tap(collector, key, result=key)
        return jax.random.uniform(key)

    key = jax.random.key(7)
    assert f(key) == jax.random.uniform(key)
    hcb.barrier_wait()
    (tapped,) = collector.values
    assert jax.random.key_impl(tapped) == jax.random.key_impl(key)
    np.testing.assert_array_equal(jax.random.key_data(tapped), jax.random.key_data(key))


def test_a_tapped_key_is_returned_as_a_key_the_computation_can_use(transport, collector):
    @jax.jit
    def f(key):
        return jax.random.normal(hcb.id_tap(collector, key))

    key = jax.random.key(3, impl="rbg")
    assert f(key) == jax.random.normal(key)
    hcb.barrier_wait()
    assert str(jax.random.key_impl(collector.values[0])) == "rbg"


@pytest.mark.needs_internals("transforms in tap functions (vmap taps once per batch element)")
def test_a_batch_of_keys_under_vmap_arrives_as_a_batch_of_keys(transport, collector):
    keys = jax.random.split(jax.random.key(0), 3)
    jax.vmap(lambda k: hcb.id_tap(collector, k))(keys)
    hcb.barrier_wait()
    ((tapped, transforms),) = [(c[0], c[1]) for c in collector.calls]
    assert tapped.shape == (3,) and transforms == (("batch", {"batch_dims": (0,)}),)
    np.testing.assert_array_equal(jax.random.key_data(tapped), jax.random.key_data(keys))


def test_a_call_receives_a_key_argument_as_a_key(transport):
    def host(key):
        return np.asarray(jax.random.key_data(key)[..., 0])

    key = jax.random.key(11)
    out = jax.jit(lambda k: hcb.call(host, k, result_shape=jax.ShapeDtypeStruct((), jnp.uint32)))(
        key)
    assert out == jax.random.key_data(key)[0]


# ---- jax.export ----------------------------------------------------------------------------


@pytest.mark.needs_internals("hostcallback's own message for jax.export of a tap or call "
                             "(JAX's is given)")
@pytest.mark.parametrize("tapped", ["tap", "call"])
def test_exporting_a_function_with_a_tap_or_call_is_a_clear_error(transport, tapped):
    def f(x):
        if tapped == "tap":
            return hcb.id_tap(lambda a, t: None, x) * 2
        return hcb.call(lambda a: a, x, result_shape=x) * 2

    with pytest.raises(NotImplementedError, match=rf"jax.export cannot serialize a function "
                                                  rf"with a hostcallback {tapped}.*exported.call"):
        jax.export.export(jax.jit(f))(jax.ShapeDtypeStruct((3,), jnp.float32))


def test_tapping_around_an_exported_call_works(transport, collector):
    exported = jax.export.export(jax.jit(lambda x: x * 2))(
        jax.ShapeDtypeStruct((3,), jnp.float32))
    out = jax.jit(lambda x: hcb.id_tap(collector, exported.call(x)))(jnp.arange(3.0))
    hcb.barrier_wait()
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(collector.values[0], [0.0, 2.0, 4.0])


def test_with_x64_on_a_call_needs_the_exact_result_dtype_as_legacy_did(transport):
    with jax.enable_x64(True):
        f = jax.jit(lambda x: hcb.call(lambda v: np.zeros(3), x,
                                       result_shape=jax.ShapeDtypeStruct((3,), jnp.float32)))
        with pytest.raises(Exception, match=r"returned float64\[3\] .* says float32\[3\]"):
            f(1.0).block_until_ready()
    hcb.barrier_wait()  # a failed call is reported once, where it failed (issue 11 item 4)
