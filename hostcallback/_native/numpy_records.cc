// Turns drained records into Python objects (zero-copy, read-only numpy views made with the
// NumPy C API from cached dtype objects) and checks host arrays on their way into a record.

#include "numpy_records.h"
#include "numpy_api.h"  // first: before any other NumPy header

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "buffer_pool.h"
#include "constants.h"
#include "nanobind/stl/string.h"

namespace nb = nanobind;

namespace hostcallback {
namespace {

// Read-only: a consumer writing through a record's memory must not reach the pool.
using RecordArray = nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>>;

PyArray_Descr* g_dtypes[256] = {};
bool g_dtypes_loaded = false;

// Owns one drained record until the last array viewing it is gone, then returns it: a
// consumer that keeps one array keeps its own record alive, never its batch.
struct RecordOwner {
  explicit RecordOwner(const Record& r) : record(r) {
    g_records_held.fetch_add(1, std::memory_order_relaxed);
  }
  ~RecordOwner() {
    ReleaseRecord(record);
    g_records_held.fetch_sub(1, std::memory_order_relaxed);
  }
  Record record;
};

// The record's owner as a Python object. Throws with the record released.
nb::object CapsuleFor(const Record& r) {
  std::unique_ptr<RecordOwner> owner(new (std::nothrow) RecordOwner(r));
  if (!owner) {
    ReleaseRecord(r);
    throw std::bad_alloc();
  }
  nb::capsule capsule(owner.get(), [](void* p) noexcept { delete static_cast<RecordOwner*>(p); });
  owner.release();
  return capsule;
}

// Elements in an array of these dimensions, or -1 when one is negative or the count overflows.
int64_t ElementCount(const int64_t* dims, size_t ndim) {
  int64_t count = 1;
  for (size_t d = 0; d < ndim; ++d) {
    if (dims[d] < 0) return -1;
    if (dims[d] != 0 && count > INT64_MAX / dims[d]) return -1;
    count *= dims[d];
  }
  return count;
}

// count elements of itemsize bytes each, or -1 when that does not fit in 64 bits (a shape of
// 2^62 elements of 4 bytes must not wrap around to 0 bytes).
int64_t ByteCount(int64_t count, size_t itemsize) {
  int64_t bytes = 0;
  if (count < 0 || __builtin_mul_overflow(count, static_cast<int64_t>(itemsize), &bytes)) {
    return -1;
  }
  return bytes;
}

// Takes a drained record's tuple out of the cycle collector's lists. Such a tuple holds only
// ints, a str or numpy arrays of numbers, none of which can refer back to it, so it can never be
// part of a cycle; CPython itself untracks such tuples, but only when a collection first walks
// them. Left tracked, a batch of 1,024 records makes the collector walk and promote 2,048
// objects, and the full collections that promotion sets off take as long as the receiver's own
// Python: a fifth of its time.
void UntrackFromGc(PyObject* tuple) {
  if (PyObject_GC_IsTracked(tuple)) PyObject_GC_UnTrack(tuple);
}

// The arrays of one record, as a tuple of read-only numpy views whose base is `owner`. The
// record was built by EncodeRecord; every count, size and offset is still checked against the
// record's size, and each array's bytes against its shape, so that no view reaches outside it.
nb::tuple ArraysOf(const Record& r, PyObject* owner) {
  const uint32_t count = Get<uint32_t>(r.data + kArrayCountOffset);
  const size_t header = Get<uint32_t>(r.data + kHeaderSizeOffset);
  // Before the tuple is made: PyTuple_New writes every slot of what a corrupt count asks for.
  if (header < kFixedHeaderBytes || header > r.size ||
      count > (header - kFixedHeaderBytes) / kDescriptorBytes) {
    throw std::runtime_error("corrupt record header");
  }
  nb::tuple arrays = nb::steal<nb::tuple>(PyTuple_New(count));
  if (!arrays.is_valid()) throw nb::python_error();
  size_t at = kFixedHeaderBytes, offset = header;
  npy_intp dims[kMaxNdim];
  for (uint32_t i = 0; i < count; ++i) {
    if (at + kDescriptorBytes > header) throw std::runtime_error("corrupt record header");
    const uint8_t code = r.data[at];
    const uint16_t ndim = Get<uint16_t>(r.data + at + 2);
    const uint64_t byte_size = Get<uint64_t>(r.data + at + 8);
    if (ndim > kMaxNdim) {
      throw std::runtime_error("an array of " + std::to_string(ndim) +
                               " dimensions; numpy makes arrays of at most 64");
    }
    if (at + kDescriptorBytes + 8 * ndim > header) {
      throw std::runtime_error("corrupt record header");
    }
    int64_t shape[kMaxNdim];
    for (uint16_t d = 0; d < ndim; ++d) {
      shape[d] = Get<int64_t>(r.data + at + kDescriptorBytes + 8 * d);
      dims[d] = static_cast<npy_intp>(shape[d]);
    }
    at += kDescriptorBytes + 8 * ndim;
    offset = AlignUp(offset);
    if (byte_size > r.size - std::min(offset, r.size)) {
      throw std::runtime_error("corrupt record: an array runs past its end");
    }
    PyArray_Descr* descr = g_dtypes[code];
    if (descr == nullptr) throw std::runtime_error("record with an unknown dtype code");
    const int64_t bytes = ByteCount(ElementCount(shape, ndim), PyDataType_ELSIZE(descr));
    if (bytes < 0 || static_cast<uint64_t>(bytes) != byte_size) {
      throw std::runtime_error("corrupt record: an array's shape does not match its bytes");
    }
    Py_INCREF(descr);  // stolen by PyArray_NewFromDescr
    PyObject* array = PyArray_NewFromDescr(&PyArray_Type, descr, ndim, dims, nullptr,
                                           r.data + offset, NPY_ARRAY_C_CONTIGUOUS, nullptr);
    if (array == nullptr) throw nb::python_error();
    PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(array), NPY_ARRAY_WRITEABLE);
    Py_INCREF(owner);  // stolen by PyArray_SetBaseObject, even when it fails
    if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(array), owner) < 0) {
      Py_DECREF(array);
      throw nb::python_error();
    }
    PyTuple_SET_ITEM(arrays.ptr(), i, array);
    offset += byte_size;
  }
  UntrackFromGc(arrays.ptr());
  return arrays;
}

}  // namespace

void LoadDtypes() {
  if (g_dtypes_loaded) return;
  nb::module_::import_("ml_dtypes");  // registers the names of its dtypes with numpy
  for (const WireDtype& dtype : kWireDtypes) {
    PyArray_Descr* descr = nullptr;
    if (!PyArray_DescrConverter(nb::str(dtype.name).ptr(), &descr)) throw nb::python_error();
    g_dtypes[dtype.code] = descr;  // a new reference, kept forever
  }
  g_dtypes_loaded = true;
}

nb::tuple DecodeRecords(std::vector<Record>& records, std::vector<uint64_t>& marker_values) {
  // Barrier markers first, before any Python object is made.
  try {
    marker_values.reserve(marker_values.size() + records.size());
  } catch (...) {
    for (const Record& r : records) ReleaseRecord(r);
    throw;
  }
  size_t kept = 0;
  for (const Record& r : records) {
    if (Get<uint64_t>(r.data + kConsumerIdOffset) != kBarrierMarkerId) {
      records[kept++] = r;
      continue;
    }
    const size_t header = Get<uint32_t>(r.data + kHeaderSizeOffset);
    marker_values.push_back(header + 8 <= r.size ? Get<uint64_t>(r.data + header) : 0);
    ReleaseRecord(r);
  }
  records.resize(kept);
  size_t unowned = 0;  // records from here on are neither owned by a capsule nor released
  try {
    nb::list markers;
    for (uint64_t m : marker_values) markers.append(m);
    nb::list out;
    for (size_t i = 0; i < records.size(); ++i) {
      const Record r = records[i];
      unowned = i + 1;
      nb::object owner = CapsuleFor(r);  // owns r from here, or has released it and thrown
      nb::object arrays;
      try {
        arrays = ArraysOf(r, owner.ptr());
      } catch (const std::exception& e) {  // nb::python_error too
        arrays = nb::str(e.what());
      }
      static_assert(kRecordConsumerId == 0 && kRecordDeviceId == 1 && kRecordSequence == 2 &&
                        kRecordFlags == 3 && kRecordLeaves == 4 && kRecordFields == 5,
                    "the fields below are made in the order constants.h gives");
      nb::tuple record = nb::make_tuple(Get<uint64_t>(r.data + kConsumerIdOffset),
                                        Get<uint32_t>(r.data + kDeviceOffset),
                                        Get<uint64_t>(r.data + kSequenceOffset),
                                        Get<uint16_t>(r.data + kFlagsOffset), std::move(arrays));
      UntrackFromGc(record.ptr());
      out.append(std::move(record));
    }
    return nb::make_tuple(out, markers);
  } catch (...) {
    for (size_t i = unowned; i < records.size(); ++i) ReleaseRecord(records[i]);
    throw;
  }
}

nb::list RawRecords(std::vector<Record>& records) {
  size_t unowned = 0;  // records from here on are not owned by a capsule yet
  try {
    nb::list out;
    for (size_t i = 0; i < records.size(); ++i) {
      std::unique_ptr<Record> owned(new Record(records[i]));
      nb::capsule owner(owned.get(), [](void* p) noexcept {
        Record* record = static_cast<Record*>(p);
        ReleaseRecord(*record);
        delete record;
      });
      Record* record = owned.release();
      unowned = i + 1;  // the capsule releases this one, also if what follows throws
      size_t shape[1] = {record->size};
      out.append(RecordArray(record->data, 1, shape, owner));
    }
    return out;
  } catch (...) {
    for (size_t i = unowned; i < records.size(); ++i) ReleaseRecord(records[i]);
    throw;
  }
}

std::vector<ArrayView> ViewsOf(const HostLeaves& leaves) {
  LoadDtypes();
  std::vector<ArrayView> arrays;
  for (const auto& [dtype, dims, bytes] : leaves) {
    if (dtype < 0 || dtype > 255 || g_dtypes[dtype] == nullptr) {
      throw nb::value_error(("unknown wire dtype code " + std::to_string(dtype)).c_str());
    }
    if (dims.size() > UINT16_MAX) throw nb::value_error("an array of more than 65535 dimensions");
    const int64_t byte_count =
        ByteCount(ElementCount(dims.data(), dims.size()), PyDataType_ELSIZE(g_dtypes[dtype]));
    if (byte_count < 0 || static_cast<uint64_t>(byte_count) != bytes.size()) {
      throw nb::value_error("an array's bytes do not match its shape and dtype");
    }
    arrays.push_back(ArrayView{static_cast<uint8_t>(dtype), dims.data(), dims.size(), bytes.data(),
                               bytes.size()});
  }
  return arrays;
}

}  // namespace hostcallback
