// The constants the C++ core and the Python side share, each defined once, here: the wire
// format's numbers (docs/wire-format.md), the fields of a drained record, "all devices" and the
// platform our FFI handlers serve.
// module.cc exports those Python needs as attributes of the extension (WIRE_VERSION, ...), so
// that Python reads them instead of repeating them. Header only: nothing here has a body.
#ifndef HOSTCALLBACK_NATIVE_CONSTANTS_H_
#define HOSTCALLBACK_NATIVE_CONSTANTS_H_

#include <cstddef>
#include <cstdint>

namespace hostcallback {

// ---- wire format (hostcallback/_records/wire.py decodes it; docs/wire-format.md)
// -----------------------

inline constexpr uint32_t kMagic = 0x31424348;  // the bytes "HCB1"
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kFixedHeaderBytes = 48;
inline constexpr size_t kDescriptorBytes = 16;  // plus 8 bytes per dimension
inline constexpr size_t kAlignment = 64;        // every payload starts 64-byte aligned
inline constexpr size_t kMaxNdim = 64;          // numpy's limit: a record's arrays become numpy's

// Byte offsets of the fixed header's fields.
inline constexpr size_t kFlagsOffset = 6;
inline constexpr size_t kConsumerIdOffset = 8;
inline constexpr size_t kDeviceOffset = 16;
inline constexpr size_t kArrayCountOffset = 20;
inline constexpr size_t kSequenceOffset = 24;
inline constexpr size_t kHeaderSizeOffset = 32;
inline constexpr size_t kRecordSizeOffset = 40;

inline constexpr uint16_t kFlagExpectsResponse = 1;  // a `call`: the device waits for the answer
// A tap or call made from Python (the callback transport): its record holds a ticket, not the
// arrays, which are handed over in Python without a copy, as a call's answer is
// (hostcallback/_records/handover.py).
inline constexpr uint16_t kFlagHandedOverInPython = 2;
inline constexpr uint64_t kBarrierMarkerId = 0;  // the consumer id of a barrier marker

// The dtype of an array on the wire, by code (XLA's PrimitiveType numbers), as numpy names it;
// the float8 and bfloat16 names are ml_dtypes'. Codes not listed here cannot be tapped.
struct WireDtype {
  uint8_t code;
  const char* name;
};
inline constexpr WireDtype kWireDtypes[] = {
    {1, "bool"},
    {2, "int8"},
    {3, "int16"},
    {4, "int32"},
    {5, "int64"},
    {6, "uint8"},
    {7, "uint16"},
    {8, "uint32"},
    {9, "uint64"},
    {10, "float16"},
    {11, "float32"},
    {12, "float64"},
    {15, "complex64"},
    {16, "bfloat16"},
    {18, "complex128"},
    {19, "float8_e5m2"},
    {20, "float8_e4m3fn"},
    {23, "float8_e4m3b11fnuz"},
    {24, "float8_e5m2fnuz"},
    {25, "float8_e4m3fnuz"},
};

// ---- a decoded record: positions in the tuples drain() builds
// (hostcallback/_records/record_layout.py) --

inline constexpr int kRecordConsumerId = 0;
inline constexpr int kRecordDeviceId = 1;
inline constexpr int kRecordSequence = 2;
inline constexpr int kRecordFlags = 3;
inline constexpr int kRecordLeaves = 4;  // the arrays, or why the record could not be decoded
inline constexpr int kRecordFields = 5;

// ---- lowering ---------------------------------------------------------------------------------

// emit_device: each device that runs the tap (or call) enqueues, not one chosen device.
inline constexpr int64_t kAllDevices = -1;

// Where our FFI handlers are registered, and the queues the native handlers use.
inline constexpr char kNativePlatform[] = "cpu";
// The platform JAX names a CUDA device by (Device.platform), whose queues the GPU tap fills.
inline constexpr char kGpuPlatform[] = "gpu";

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_CONSTANTS_H_
