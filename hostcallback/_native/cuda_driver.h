// The few CUDA driver API entry points a GPU tap uses, found at run time in the driver that JAX's
// CUDA plugin loaded (libcuda.so.1): the core links against no CUDA library and needs no CUDA
// header, so a CPU-only install carries no CUDA dependency. The declarations are the driver API's
// stable C ABI (cuda.h); where CMake finds cuda.h, cuda_driver.cc checks them against it.
#ifndef HOSTCALLBACK_NATIVE_CUDA_DRIVER_H_
#define HOSTCALLBACK_NATIVE_CUDA_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#ifdef HOSTCALLBACK_CHECK_CUDA_H
#include <cuda.h>  // the check build: CUresult itself, so that cuda_driver.cc compares signatures
#endif

struct CUstream_st;  // cuda.h's opaque types: the stream XLA hands a GPU handler, a context,
struct CUctx_st;     // an event
struct CUevent_st;

namespace hostcallback::cuda {

#ifdef HOSTCALLBACK_CHECK_CUDA_H
using Result = CUresult;
#else
using Result = int;         // CUresult, an enum of int: 0 is CUDA_SUCCESS
#endif
using Stream = CUstream_st*;
using Context = CUctx_st*;
using Event = CUevent_st*;
using DevicePtr = unsigned long long;  // CUdeviceptr
#ifdef HOSTCALLBACK_CHECK_CUDA_H
using CaptureStatus = CUstreamCaptureStatus;
#else
using CaptureStatus = int;  // CUstreamCaptureStatus, an enum of int
#endif

inline constexpr unsigned kHostAllocPortable = 0x01;   // CU_MEMHOSTALLOC_PORTABLE
inline constexpr unsigned kHostAllocDeviceMap = 0x02;  // CU_MEMHOSTALLOC_DEVICEMAP
inline constexpr unsigned kStreamWaitValueGeq = 0x0;   // CU_STREAM_WAIT_VALUE_GEQ
inline constexpr int kErrorNotReady = 600;             // CUDA_ERROR_NOT_READY
inline constexpr unsigned kEventBlockingSync = 0x1;    // CU_EVENT_BLOCKING_SYNC
inline constexpr unsigned kEventDisableTiming = 0x2;   // CU_EVENT_DISABLE_TIMING
inline constexpr int kStreamCaptureStatusNone = 0;     // CU_STREAM_CAPTURE_STATUS_NONE

struct Driver {
  Result (*mem_host_alloc)(void** host, size_t bytes, unsigned flags);  // cuMemHostAlloc
  Result (*mem_free_host)(void* host);                                  // cuMemFreeHost
  Result (*memcpy_dtoh_async)(void* dst, DevicePtr src, size_t bytes,
                              Stream);                           // cuMemcpyDtoHAsync_v2
  Result (*ctx_get_current)(Context* context);                   // cuCtxGetCurrent
  Result (*stream_get_ctx)(Stream, Context* context);            // cuStreamGetCtx
  Result (*ctx_push_current)(Context context);                   // cuCtxPushCurrent_v2
  Result (*ctx_pop_current)(Context* context);                   // cuCtxPopCurrent_v2
  Result (*get_error_string)(Result error, const char** text);   // cuGetErrorString
  Result (*stream_query)(Stream);                                // cuStreamQuery
  Result (*stream_is_capturing)(Stream, CaptureStatus* status);  // cuStreamIsCapturing
  Result (*memset_d32_async)(DevicePtr dst, unsigned value, size_t count,
                             Stream);                    // cuMemsetD32Async
  Result (*event_create)(Event* event, unsigned flags);  // cuEventCreate
  Result (*event_record)(Event event, Stream);           // cuEventRecord
  Result (*event_synchronize)(Event event);              // cuEventSynchronize
  Result (*ctx_set_current)(Context context);            // cuCtxSetCurrent
  Result (*mem_host_get_device_pointer)(DevicePtr* device, void* host,
                                        unsigned flags);  // cuMemHostGetDevicePointer_v2
  Result (*stream_wait_value32)(Stream, DevicePtr address, uint32_t value,
                                unsigned flags);  // cuStreamWaitValue32_v2
};

// The driver's entry points, found once; null (and *why says why) where no CUDA driver is loaded
// or it lacks one of them.
const Driver* GetDriver(std::string* why);

// "what failed: the driver's words (code)".
std::string Describe(const Driver& driver, const char* what, Result result);

}  // namespace hostcallback::cuda

#endif  // HOSTCALLBACK_NATIVE_CUDA_DRIVER_H_
