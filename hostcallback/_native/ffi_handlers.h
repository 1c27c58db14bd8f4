// The XLA FFI handlers our custom calls run on the device thread: hostcallback_tap (and
// hostcallback_tap_handled), hostcallback_call, hostcallback_shared_call, hostcallback_order,
// hostcallback_check, hostcallback_begin and hostcallback_fence (module.cc hands them to Python,
// which registers them with jax.ffi for kNativePlatform).
#ifndef HOSTCALLBACK_NATIVE_FFI_HANDLERS_H_
#define HOSTCALLBACK_NATIVE_FFI_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

namespace hostcallback {

// A tap (a barrier marker is a tap of consumer kBarrierMarkerId): attributes consumer_id,
// emit_device; operands the ordering token and the tapped arrays; result the token.
extern "C" XLA_FFI_Error* HostcallbackTap(XLA_FFI_CallFrame* call_frame);

// A `call`: attributes consumer_id, emit_device, timeout_s; results the token, the host's
// answer and, for a call shared over the devices of a sharded computation, a failure flag.
extern "C" XLA_FFI_Error* HostcallbackCall(XLA_FFI_CallFrame* call_frame);

// A call shared over the devices of a sharded computation in this process, met in the handler
// (shared_calls.h): attributes consumer_id, emit_device (the calling device), ordinals (its
// devices), sends (which device sends which operand), timeout_s, name; operands the token and
// this device's shard; results the token and the host's answer, then a uint32 1.
extern "C" XLA_FFI_Error* HostcallbackSharedCall(XLA_FFI_CallFrame* call_frame);

// A point in the program order: operands a token and values; results a token and uint32 zeros
// that come after them.
extern "C" XLA_FFI_Error* HostcallbackOrder(XLA_FFI_CallFrame* call_frame);

// A shared call's check after its results and flags were summed: attribute consumer_id.
extern "C" XLA_FFI_Error* HostcallbackCheck(XLA_FFI_CallFrame* call_frame);

// A tap that returns once its record has been handled (the portable mode's): as HostcallbackTap.
extern "C" XLA_FFI_Error* HostcallbackTapHandled(XLA_FFI_CallFrame* call_frame);

// The start of a tapped computation: operand a token; results a token and the computation's
// uint32 id.
extern "C" XLA_FFI_Error* HostcallbackBegin(XLA_FFI_CallFrame* call_frame);

// The end of a tapped computation: operands its taps' tokens and the id Begin gave; result a
// token; returns once the device's receiver has handled every tap enqueued before it.
extern "C" XLA_FFI_Error* HostcallbackFence(XLA_FFI_CallFrame* call_frame);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_FFI_HANDLERS_H_
