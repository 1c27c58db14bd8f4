// Finds the CUDA driver's entry points (cuda_driver.h) with dlsym, once.

#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

#ifdef HOSTCALLBACK_CHECK_CUDA_H
#include <type_traits>
#endif

namespace hostcallback::cuda {

#ifdef HOSTCALLBACK_CHECK_CUDA_H
// Where cuda.h is at hand (CMake's HOSTCALLBACK_CHECK_CUDA_H), our declarations must be its.
#define HOSTCALLBACK_SAME(field, function) \
  static_assert(std::is_same_v<decltype(Driver::field), decltype(&function)>, #function)
HOSTCALLBACK_SAME(mem_host_alloc, cuMemHostAlloc);
HOSTCALLBACK_SAME(mem_free_host, cuMemFreeHost);
HOSTCALLBACK_SAME(memcpy_dtoh_async, cuMemcpyDtoHAsync_v2);
HOSTCALLBACK_SAME(ctx_get_current, cuCtxGetCurrent);
HOSTCALLBACK_SAME(stream_get_ctx, cuStreamGetCtx);
HOSTCALLBACK_SAME(ctx_push_current, cuCtxPushCurrent_v2);
HOSTCALLBACK_SAME(ctx_pop_current, cuCtxPopCurrent_v2);
HOSTCALLBACK_SAME(get_error_string, cuGetErrorString);
HOSTCALLBACK_SAME(stream_query, cuStreamQuery);
HOSTCALLBACK_SAME(stream_is_capturing, cuStreamIsCapturing);
HOSTCALLBACK_SAME(memset_d32_async, cuMemsetD32Async);
HOSTCALLBACK_SAME(event_create, cuEventCreate);
HOSTCALLBACK_SAME(event_record, cuEventRecord);
HOSTCALLBACK_SAME(event_synchronize, cuEventSynchronize);
HOSTCALLBACK_SAME(ctx_set_current, cuCtxSetCurrent);
HOSTCALLBACK_SAME(mem_host_get_device_pointer, cuMemHostGetDevicePointer_v2);
HOSTCALLBACK_SAME(stream_wait_value32, cuStreamWaitValue32_v2);
#undef HOSTCALLBACK_SAME
static_assert(std::is_same_v<Stream, CUstream> && std::is_same_v<Context, CUcontext>);
static_assert(std::is_same_v<Event, CUevent>);
static_assert(kEventBlockingSync == CU_EVENT_BLOCKING_SYNC);
static_assert(kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(std::is_same_v<DevicePtr, CUdeviceptr>);
static_assert(CUDA_SUCCESS == 0 && kHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(kHostAllocDeviceMap == CU_MEMHOSTALLOC_DEVICEMAP);
static_assert(kStreamWaitValueGeq == CU_STREAM_WAIT_VALUE_GEQ);
static_assert(kErrorNotReady == CUDA_ERROR_NOT_READY);
static_assert(kStreamCaptureStatusNone == CU_STREAM_CAPTURE_STATUS_NONE);
#endif

namespace {

template <typename Fn>
bool Find(void* library, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(library, name));
  return *out != nullptr;
}

const Driver* Load(std::string* why) {
  // JAX's CUDA plugin has loaded the driver where a CUDA backend runs; else load it (a GPU
  // handler runs only on a CUDA device, so the driver is there).
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) library = dlopen("libcuda.so.1", RTLD_NOW);
  if (library == nullptr) {
    *why = "hostcallback: no CUDA driver (libcuda.so.1) could be loaded for a GPU tap";
    return nullptr;
  }
  static Driver driver;
  const char* missing = nullptr;
  if (!Find(library, "cuMemHostAlloc", &driver.mem_host_alloc)) missing = "cuMemHostAlloc";
  if (!Find(library, "cuMemFreeHost", &driver.mem_free_host)) missing = "cuMemFreeHost";
  if (!Find(library, "cuMemcpyDtoHAsync_v2", &driver.memcpy_dtoh_async)) {
    missing = "cuMemcpyDtoHAsync_v2";
  }
  if (!Find(library, "cuCtxGetCurrent", &driver.ctx_get_current)) missing = "cuCtxGetCurrent";
  if (!Find(library, "cuStreamGetCtx", &driver.stream_get_ctx)) missing = "cuStreamGetCtx";
  if (!Find(library, "cuCtxPushCurrent_v2", &driver.ctx_push_current)) {
    missing = "cuCtxPushCurrent_v2";
  }
  if (!Find(library, "cuCtxPopCurrent_v2", &driver.ctx_pop_current)) {
    missing = "cuCtxPopCurrent_v2";
  }
  if (!Find(library, "cuGetErrorString", &driver.get_error_string)) missing = "cuGetErrorString";
  if (!Find(library, "cuStreamQuery", &driver.stream_query)) missing = "cuStreamQuery";
  if (!Find(library, "cuStreamIsCapturing", &driver.stream_is_capturing)) {
    missing = "cuStreamIsCapturing";
  }
  if (!Find(library, "cuMemsetD32Async", &driver.memset_d32_async)) missing = "cuMemsetD32Async";
  if (!Find(library, "cuEventCreate", &driver.event_create)) missing = "cuEventCreate";
  if (!Find(library, "cuEventRecord", &driver.event_record)) missing = "cuEventRecord";
  if (!Find(library, "cuEventSynchronize", &driver.event_synchronize)) {
    missing = "cuEventSynchronize";
  }
  if (!Find(library, "cuCtxSetCurrent", &driver.ctx_set_current)) missing = "cuCtxSetCurrent";
  if (!Find(library, "cuMemHostGetDevicePointer_v2", &driver.mem_host_get_device_pointer)) {
    missing = "cuMemHostGetDevicePointer_v2";
  }
  if (!Find(library, "cuStreamWaitValue32_v2", &driver.stream_wait_value32)) {
    missing = "cuStreamWaitValue32_v2";
  }
  if (missing != nullptr) {
    *why = std::string("hostcallback: the CUDA driver lacks ") + missing +
           ", which a GPU tap needs (CUDA 12 or newer)";
    return nullptr;
  }
  return &driver;
}

}  // namespace

const Driver* GetDriver(std::string* why) {
  static std::once_flag once;
  static const Driver* driver = nullptr;
  static std::string failure;
  std::call_once(once, [] { driver = Load(&failure); });
  if (driver == nullptr && why != nullptr) *why = failure;
  return driver;
}

std::string Describe(const Driver& driver, const char* what, Result result) {
  const char* text = nullptr;
  if (static_cast<int>(driver.get_error_string(result, &text)) != 0 || text == nullptr) {
    text = "unknown error";
  }
  return std::string("hostcallback: ") + what + " failed: " + text + " (CUDA error " +
         std::to_string(static_cast<int>(result)) + ")";
}

}  // namespace hostcallback::cuda
