// hostcallback.consumer._frames: record-stream frames for many drained records at once (the
// format: consumer/stream.py, "Record stream format"), the sinks' fast path. An extension of the
// consumer package's own, apart from the device core: the stream format is the consumers'.
//
// The records of one tap site from one device differ only in their arrays' bytes, the step, the
// sequence number and the time; every other byte of their frames is the same. Python
// (consumer/frame_templates.py, FrameTemplate) packs those fixed bytes once, as pieces around the
// holes, and checks the result against its general encoder before using it. Here each record's
// frame is put together from the pieces: the arrays' bytes copied in, the three numbers packed as
// msgpack-python packs a Python int and float, and the frame's CRC-32. Nothing here decides what a
// record holds; a record that does not fit its template is refused with a ValueError, never
// written.

#include "numpy_api.h"  // first: before any other NumPy header (the core's header; a table here)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "constants.h"
#include "gil.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "record.h"

namespace nb = nanobind;

namespace hostcallback {
namespace {

// CRC-32 as zlib.crc32 computes it (reflected polynomial 0xEDB88320), eight bytes a step.
struct Crc32Tables {
  uint32_t t[8][256];
  Crc32Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

// Never destroyed; made on first use (a function-local static: thread-safe).
const Crc32Tables& Tables() {
  static const Crc32Tables* tables = new Crc32Tables();
  return *tables;
}

uint32_t Crc32(const uint8_t* data, size_t n) {
  const Crc32Tables& tb = Tables();
  uint32_t c = 0xFFFFFFFFu;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, data, 4);
    std::memcpy(&hi, data + 4, 4);
    lo ^= c;  // little-endian hosts only (the whole core assumes it: the wire format is native)
    c = tb.t[7][lo & 0xFF] ^ tb.t[6][(lo >> 8) & 0xFF] ^ tb.t[5][(lo >> 16) & 0xFF] ^
        tb.t[4][lo >> 24] ^ tb.t[3][hi & 0xFF] ^ tb.t[2][(hi >> 8) & 0xFF] ^
        tb.t[1][(hi >> 16) & 0xFF] ^ tb.t[0][hi >> 24];
    data += 8;
    n -= 8;
  }
  while (n--) c = tb.t[0][(c ^ *data++) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// ---- msgpack, as msgpack-python packs a Python int and a Python float ----------------------

size_t PutBigEndian(uint8_t* out, uint64_t value, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<uint8_t>(value >> (8 * (bytes - 1 - i)));
  return bytes;
}

// The smallest encoding: positive fixint, then uint 8/16/32/64.
size_t PackUnsigned(uint8_t* out, uint64_t v) {
  if (v < 0x80) return out[0] = static_cast<uint8_t>(v), 1;
  if (v < 0x100) return out[0] = 0xcc, 1 + PutBigEndian(out + 1, v, 1);
  if (v < 0x10000) return out[0] = 0xcd, 1 + PutBigEndian(out + 1, v, 2);
  if (v < 0x100000000ull) return out[0] = 0xce, 1 + PutBigEndian(out + 1, v, 4);
  return out[0] = 0xcf, 1 + PutBigEndian(out + 1, v, 8);
}

// Negative numbers: negative fixint from -32, then int 8/16/32/64.
size_t PackSigned(uint8_t* out, int64_t v) {
  if (v >= 0) return PackUnsigned(out, static_cast<uint64_t>(v));
  const uint64_t bits = static_cast<uint64_t>(v);
  if (v >= -32) return out[0] = static_cast<uint8_t>(bits), 1;
  if (v >= -128) return out[0] = 0xd0, 1 + PutBigEndian(out + 1, bits, 1);
  if (v >= -32768) return out[0] = 0xd1, 1 + PutBigEndian(out + 1, bits, 2);
  if (v >= -2147483648ll) return out[0] = 0xd2, 1 + PutBigEndian(out + 1, bits, 4);
  return out[0] = 0xd3, 1 + PutBigEndian(out + 1, bits, 8);
}

size_t PackDouble(uint8_t* out, double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  out[0] = 0xcb;
  return 1 + PutBigEndian(out + 1, bits, 8);
}

constexpr size_t kMaxPackedNumber = 9;
constexpr uint8_t kNil = 0xc0;
// The frame header: the sync marker b"\xc1hcb", then the payload's length and CRC-32, both
// little-endian uint32 (consumer/stream.py: SYNC, FRAME).
constexpr uint8_t kSync[4] = {0xc1, 'h', 'c', 'b'};
constexpr size_t kFrameHeaderBytes = 12;
// Frames at least this large are copied and checksummed with the GIL released.
constexpr size_t kReleaseGilBytes = size_t{64} << 10;

// A step read from the step leaf's first element, packed as msgpack-python packs int(step).
size_t PackStep(uint8_t* out, const uint8_t* at, char kind, size_t size) {
  if (kind == 'b') return PackUnsigned(out, at[0] != 0);
  if (kind == 'u') {
    switch (size) {
      case 1: return PackUnsigned(out, Get<uint8_t>(at));
      case 2: return PackUnsigned(out, Get<uint16_t>(at));
      case 4: return PackUnsigned(out, Get<uint32_t>(at));
      case 8: return PackUnsigned(out, Get<uint64_t>(at));
      default: return PackUnsigned(out, 0);
    }
  }
  switch (size) {
    case 1: return PackSigned(out, Get<int8_t>(at));
    case 2: return PackSigned(out, Get<int16_t>(at));
    case 4: return PackSigned(out, Get<int32_t>(at));
    case 8: return PackSigned(out, Get<int64_t>(at));
    default: return PackSigned(out, 0);
  }
}

double WallClockSeconds() {  // what time.time() returns
  timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// What every record of a template has at one leaf: its dtype and shape, hence its size.
struct LeafSpec {
  nb::object dtype;  // owns descr
  PyArray_Descr* descr;
  std::vector<npy_intp> shape;
  size_t bytes;
};

std::vector<LeafSpec> LeafSpecs(const std::vector<nb::object>& dtypes,
                                const std::vector<std::vector<int64_t>>& shapes) {
  if (dtypes.size() != shapes.size()) throw nb::value_error("one dtype and one shape per leaf");
  std::vector<LeafSpec> specs(dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    PyArray_Descr* descr = nullptr;
    if (!PyArray_DescrConverter(dtypes[i].ptr(), &descr)) throw nb::python_error();
    specs[i].dtype = nb::steal(reinterpret_cast<PyObject*>(descr));
    specs[i].descr = descr;
    size_t bytes = static_cast<size_t>(PyDataType_ELSIZE(descr));
    for (int64_t dim : shapes[i]) {
      if (dim < 0) throw nb::value_error("a negative dimension");
      specs[i].shape.push_back(static_cast<npy_intp>(dim));
      if (__builtin_mul_overflow(bytes, static_cast<size_t>(dim), &bytes)) {
        throw nb::value_error("a leaf's shape has more bytes than fit in 64 bits");
      }
    }
    specs[i].bytes = bytes;
  }
  return specs;
}

// The data of a record's leaf, which must be a C-contiguous numpy array of the spec's dtype and
// shape (else a ValueError: a template describes its records exactly, or is not used).
const uint8_t* LeafData(PyObject* leaf, const LeafSpec& spec) {
  if (!PyArray_Check(leaf)) throw nb::value_error("a record's leaf is not a numpy array");
  PyArrayObject* array = reinterpret_cast<PyArrayObject*>(leaf);
  if (PyArray_DESCR(array) != spec.descr && !PyArray_EquivTypes(PyArray_DESCR(array), spec.descr)) {
    throw nb::value_error("a record's array does not have its template's dtype");
  }
  if (static_cast<size_t>(PyArray_NDIM(array)) != spec.shape.size() ||
      !std::equal(spec.shape.begin(), spec.shape.end(), PyArray_DIMS(array))) {
    throw nb::value_error("a record's array does not have its template's shape");
  }
  if (!PyArray_IS_C_CONTIGUOUS(array)) {
    throw nb::value_error("a record's array is not C-contiguous");
  }
  return static_cast<const uint8_t*>(PyArray_DATA(array));
}

// Frames records[start:stop], each drained record being (consumer_id, device, sequence, flags,
// arrays). pieces holds len(leaf_dtypes) + 4 fixed byte strings: before each array's bytes,
// then before the step, before the sequence, before the time, and after it. step_leaf < 0: no
// step (nil); else the step is that array's first element, of kind 'i', 'u' or 'b' and
// step_size bytes. now < 0: each record's time is the wall clock as it is framed. Large frames
// are filled with the GIL released.
nb::list FrameRecords(nb::list records, size_t start, size_t stop,
                      const std::vector<nb::bytes>& pieces,
                      const std::vector<nb::object>& leaf_dtypes,
                      const std::vector<std::vector<int64_t>>& leaf_shapes, int step_leaf,
                      const std::string& step_kind, size_t step_size, double now) {
  const std::vector<LeafSpec> specs = LeafSpecs(leaf_dtypes, leaf_shapes);
  const size_t leaves = specs.size();
  if (pieces.size() != leaves + 4) throw nb::value_error("a template needs one piece per leaf + 4");
  if (stop > records.size() || start > stop) throw nb::value_error("start:stop is outside records");
  const bool has_step = step_leaf >= 0;
  if (has_step) {
    if (static_cast<size_t>(step_leaf) >= leaves) throw nb::value_error("step_leaf is not a leaf");
    if (step_kind.size() != 1 || std::string("iub").find(step_kind[0]) == std::string::npos ||
        (step_size != 1 && step_size != 2 && step_size != 4 && step_size != 8) ||
        static_cast<size_t>(PyDataType_ELSIZE(specs[step_leaf].descr)) != step_size ||
        specs[step_leaf].bytes < step_size) {
      throw nb::value_error("the step must be an integer or bool array with an element");
    }
  }
  // Plain pointers and sizes: the frames are filled without the GIL, touching no Python object.
  std::vector<std::pair<const char*, size_t>> piece(pieces.size());
  size_t fixed = kFrameHeaderBytes + 3 * kMaxPackedNumber;
  for (size_t i = 0; i < pieces.size(); ++i) {
    piece[i] = {pieces[i].c_str(), pieces[i].size()};
    fixed += piece[i].second;
  }
  for (const LeafSpec& spec : specs) fixed += spec.bytes;
  if (fixed > UINT32_MAX) throw nb::value_error("a record's frame is over 4 GiB");

  nb::list out;
  std::vector<const uint8_t*> data(leaves);
  std::vector<nb::object> held(leaves);
  for (size_t r = start; r < stop; ++r) {
    // Another thread may have shrunk the list while the GIL was released for the last frame.
    if (r >= static_cast<size_t>(PyList_GET_SIZE(records.ptr()))) {
      throw nb::value_error("records was shortened while it was being framed");
    }
    nb::object held_record = nb::borrow(PyList_GET_ITEM(records.ptr(), r));
    PyObject* record = held_record.ptr();
    if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) != kRecordFields ||
        !PyTuple_Check(PyTuple_GET_ITEM(record, kRecordLeaves)) ||
        static_cast<size_t>(PyTuple_GET_SIZE(PyTuple_GET_ITEM(record, kRecordLeaves))) != leaves) {
      throw nb::value_error("a record does not have its template's arrays");
    }
    const unsigned long long sequence =
        PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(record, kRecordSequence));
    if (PyErr_Occurred()) throw nb::python_error();
    // Each array held while we copy from it, the GIL released or not (records is mutable).
    PyObject* arrays = PyTuple_GET_ITEM(record, kRecordLeaves);
    for (size_t i = 0; i < leaves; ++i) {
      held[i] = nb::borrow(PyTuple_GET_ITEM(arrays, i));
      data[i] = LeafData(held[i].ptr(), specs[i]);
    }
    // Sized for the longest numbers, then cut to what was written.
    nb::object frame =
        nb::steal(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(fixed)));
    if (!frame.is_valid()) throw nb::python_error();
    uint8_t* const begin = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(frame.ptr()));
    const double time = now < 0 ? WallClockSeconds() : now;
    size_t length = 0;
    auto fill = [&]() {
      uint8_t* at = begin + kFrameHeaderBytes;
      auto put = [&at](const void* bytes, size_t n) {
        if (n) std::memcpy(at, bytes, n);
        at += n;
      };
      for (size_t i = 0; i < leaves; ++i) {
        put(piece[i].first, piece[i].second);
        put(data[i], specs[i].bytes);
      }
      put(piece[leaves].first, piece[leaves].second);
      if (has_step) {
        at += PackStep(at, data[step_leaf], step_kind[0], step_size);
      } else {
        *at++ = kNil;
      }
      put(piece[leaves + 1].first, piece[leaves + 1].second);
      at += PackUnsigned(at, sequence);
      put(piece[leaves + 2].first, piece[leaves + 2].second);
      at += PackDouble(at, time);
      put(piece[leaves + 3].first, piece[leaves + 3].second);
      length = static_cast<size_t>(at - begin);
      const size_t payload = length - kFrameHeaderBytes;
      const uint32_t payload_bytes = static_cast<uint32_t>(payload);
      const uint32_t crc = Crc32(begin + kFrameHeaderBytes, payload);
      std::memcpy(begin, kSync, 4);
      std::memcpy(begin + 4, &payload_bytes, 4);  // little-endian, as the frame header is
      std::memcpy(begin + 8, &crc, 4);
    };
    if (fixed >= kReleaseGilBytes) {
      GilReleased released;  // nothing below touches a Python object
      fill();
    } else {
      fill();
    }
    PyObject* raw = frame.release().ptr();
    if (_PyBytes_Resize(&raw, static_cast<Py_ssize_t>(length)) != 0) throw nb::python_error();
    out.append(nb::steal(raw));
  }
  return out;
}

}  // namespace

}  // namespace hostcallback

NB_MODULE(_frames, m) {
  using namespace hostcallback;
  m.doc() = "hostcallback.consumer's record-stream frames, put together in C++";
  if (!ImportNumpyApi()) throw nb::python_error();
  RememberMainThread(nb::cast<unsigned long>(
      nb::module_::import_("threading").attr("main_thread")().attr("ident")));
  m.def(
      "share_exit_gate",
      [](nb::capsule gate) {
        if (gate.name() == nullptr || std::strcmp(gate.name(), kExitGateCapsule) != 0) {
          throw nb::type_error("share_exit_gate() takes hostcallback's exit_gate() capsule");
        }
        ShareExitGate(static_cast<const ExitGate*>(gate.data()));
      },
      nb::arg("gate"),
      "Makes a receiver thread that frames records park at hostcallback's exit gate, as it "
      "parks in the core (hostcallback.addons.exit_gate()).");
  m.def("frame_records", &FrameRecords, nb::arg("records"), nb::arg("start"), nb::arg("stop"),
        nb::arg("pieces"), nb::arg("leaf_dtypes"), nb::arg("leaf_shapes"), nb::arg("step_leaf"),
        nb::arg("step_kind"), nb::arg("step_size"), nb::arg("now") = -1.0,
        "Record-stream frames (a list of bytes) for drained records[start:stop] of one tap "
        "site and device, from hostcallback.consumer.frame_templates.FrameTemplate's pieces; a "
        "ValueError for a record whose arrays do not have the template's dtypes and shapes.");
  m.def(
      "crc32",
      [](nb::bytes data) {
        return Crc32(reinterpret_cast<const uint8_t*>(data.c_str()), data.size());
      },
      nb::arg("data"), "CRC-32 as zlib.crc32 computes it (for tests).");
}
