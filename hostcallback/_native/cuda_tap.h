// The GPU tap: hostcallback_tap's XLA FFI handler for the CUDA platform, which never makes the
// stream wait (cuda_tap.cc; its records join their queue through cuda_commit.h).
#ifndef HOSTCALLBACK_NATIVE_CUDA_TAP_H_
#define HOSTCALLBACK_NATIVE_CUDA_TAP_H_

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace hostcallback {

// Operands the ordering token and the tapped arrays (device memory), result a token; attributes
// consumer_id and emit_device, as HostcallbackTap's.
extern "C" XLA_FFI_Error* HostcallbackTapCuda(XLA_FFI_CallFrame* call_frame);

// The begin and the end of a tapped computation on a GPU (fence.py): the begin hands out the id 0
// (a GPU computation is not tracked: its barrier markers follow it on the stream); the fence
// makes the stream wait until the device's receiver has handled every record launched before it
// (cuda_commit.h), so the computation's results are ready only once its taps were handled.
extern "C" XLA_FFI_Error* HostcallbackBeginCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* HostcallbackFenceCuda(XLA_FFI_CallFrame* call_frame);

// The global Device.id of each local CUDA device ordinal (the FFI's DeviceOrdinal), which names
// its queue ("gpu", id); an ordinal not given is its own id.
void SetCudaDeviceIds(const std::vector<int>& ids);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_CUDA_TAP_H_
