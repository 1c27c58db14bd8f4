// The tapped arrays of an XLA FFI call, for the CPU's handlers and the GPU tap alike.
#ifndef HOSTCALLBACK_NATIVE_FFI_ARRAYS_H_
#define HOSTCALLBACK_NATIVE_FFI_ARRAYS_H_

#include <cstddef>
#include <cstdint>

#include "record.h"
#include "xla/ffi/api/ffi.h"

namespace hostcallback {

// The arrays to send: every operand but the ordering token, into out (room for args.size()).
inline xla::ffi::Error CollectArrays(xla::ffi::RemainingArgs& args, ArrayView* out, size_t* count) {
  *count = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    xla::ffi::ErrorOr<xla::ffi::AnyBuffer> arg = args.get<xla::ffi::AnyBuffer>(i);
    if (!arg.has_value()) return arg.error();
    xla::ffi::AnyBuffer buffer = arg.value();
    if (buffer.element_type() == xla::ffi::DataType::TOKEN) continue;
    auto dims = buffer.dimensions();
    out[(*count)++] = ArrayView{static_cast<uint8_t>(buffer.element_type()), dims.begin(),
                                dims.size(), buffer.untyped_data(), buffer.size_bytes()};
  }
  return xla::ffi::Error::Success();
}

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_FFI_ARRAYS_H_
