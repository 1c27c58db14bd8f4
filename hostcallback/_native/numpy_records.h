// Records as numpy sees them: drained records decoded into read-only numpy views (or handed out
// undecoded), and host arrays checked against the same dtype table on their way in. Holds the
// GIL throughout.
#ifndef HOSTCALLBACK_NATIVE_NUMPY_RECORDS_H_
#define HOSTCALLBACK_NATIVE_NUMPY_RECORDS_H_

#include <cstdint>
#include <tuple>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "record.h"

namespace hostcallback {

// numpy dtype objects by wire code, made once from kWireDtypes (constants.h, the one table of
// codes) and kept for the life of the process. Call before any record leaves its queue.
void LoadDtypes();

// Decodes a drained batch in C++: returns (records, markers) where each record is
// (consumer_id, device, sequence, flags, arrays) in queue order and markers holds `markers` and
// then the values of the barrier markers of this batch (they never reach Python as records).
// arrays is a tuple of read-only views of the record, owned by one capsule per record; or, for a
// record that cannot be decoded, a str saying why, so that only its own consumer fails. Both
// tuples are left out of the cycle collector. The batch's markers are appended to `markers`
// before anything can fail, so that a caller whose decoding failed still has them, and every
// record is owned or released (ReleaseRecord) on every path: `records` is spent either way.
nanobind::tuple DecodeRecords(std::vector<Record>& records, std::vector<uint64_t>& markers);

// Hands each record out as a read-only uint8 array owning it. Exception-safe: a record is owned
// by its capsule once wrapped; if wrapping one fails, it and every later record go back to the
// pool (ReleaseRecord) before the error propagates, so nothing leaks and the caller sees the
// error.
nanobind::list RawRecords(std::vector<Record>& records);

// The callback transport's way in: the same record, built from host arrays, given as
// (dtype code, dims, bytes) leaves.
using ReadOnlyBytes =
    nanobind::ndarray<const uint8_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;
using HostLeaves = std::vector<std::tuple<int, std::vector<int64_t>, ReadOnlyBytes>>;

// Each leaf's dtype must be known and its bytes must be exactly what its shape holds: a record
// is decoded by its shapes, so a mismatch would let a view reach outside it (a ValueError).
// The views point into `leaves`, which must outlive them.
std::vector<ArrayView> ViewsOf(const HostLeaves& leaves);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_NUMPY_RECORDS_H_
