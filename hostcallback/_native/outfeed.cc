// The device side of hostcallback: per-device outfeed queues and the XLA FFI tap handler.
//
// The handler runs on XLA's device thread. It copies the tapped buffers into one record
// (header + payload, layout in docs/wire-format.md and hostcallback/wire.py) and appends it
// to that device's queue. It never runs Python and never takes the GIL. The receiver threads
// in Python call drain(), which waits here with the GIL released and hands each record out
// as a numpy uint8 array that owns the record's memory, so payloads become arrays without
// another copy. Every decision that is not about copying bytes lives in Python.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <map>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

// ---- wire format (mirrors hostcallback/wire.py) ------------------------------------------

constexpr uint32_t kMagic = 0x31424348;  // the bytes "HCB1"
constexpr uint16_t kVersion = 1;
constexpr size_t kFixedHeaderBytes = 48;
constexpr size_t kDescriptorBytes = 16;  // plus 8 bytes per dimension
constexpr size_t kAlignment = 64;        // every payload starts 64-byte aligned
constexpr size_t kSequenceOffset = 24;
constexpr size_t kRecordSizeOffset = 40;

size_t AlignUp(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

struct ArrayView {
  uint8_t dtype;
  std::vector<int64_t> dims;
  const void* data;
  uint64_t byte_size;
};

template <typename T>
void Put(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}

// A record's bytes, 64-byte aligned; handed back with ReleaseRecord by whoever holds it last.
struct Record {
  uint8_t* data = nullptr;
  size_t size = 0;
};

// Recycles large record buffers. A fresh multi-megabyte allocation is a new mapping whose pages
// fault in on first touch, which costs more than the copy itself; taps in a loop reuse one size.
class BufferPool {
 public:
  static constexpr size_t kMinPooledBytes = 64 << 10;
  static constexpr size_t kMaxPooledBytes = 64 << 20;

  uint8_t* Get(size_t size) {
    if (size >= kMinPooledBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second == size) {
          uint8_t* data = it->first;
          pooled_bytes_ -= size;
          free_.erase(it);
          return data;
        }
      }
    }
    return static_cast<uint8_t*>(std::aligned_alloc(kAlignment, size));
  }

  void Put(uint8_t* data, size_t size) {
    if (size >= kMinPooledBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      if (pooled_bytes_ + size <= kMaxPooledBytes) {
        free_.emplace_back(data, size);
        pooled_bytes_ += size;
        return;
      }
    }
    std::free(data);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<uint8_t*, size_t>> free_;
  size_t pooled_bytes_ = 0;
};

BufferPool g_pool;

// Returns a record's buffer; its size is in its own header.
void ReleaseRecord(uint8_t* data) {
  uint64_t size;
  std::memcpy(&size, data + kRecordSizeOffset, sizeof(size));
  g_pool.Put(data, size);
}

constexpr uint16_t kFlagExpectsResponse = 1;  // a `call`: the device waits for the host's answer

Record EncodeRecord(uint64_t consumer_id, uint32_t device, const std::vector<ArrayView>& arrays,
                    uint16_t flags = 0) {
  size_t header = kFixedHeaderBytes;
  for (const ArrayView& a : arrays) header += kDescriptorBytes + 8 * a.dims.size();
  header = AlignUp(header);
  size_t size = header;
  for (const ArrayView& a : arrays) size = AlignUp(size) + a.byte_size;
  size = AlignUp(std::max<size_t>(size, kAlignment));

  Record r;
  r.data = g_pool.Get(size);
  if (r.data == nullptr) return r;
  r.size = size;
  std::memset(r.data, 0, header);
  Put<uint32_t>(r.data + 0, kMagic);
  Put<uint16_t>(r.data + 4, kVersion);
  Put<uint16_t>(r.data + 6, flags);
  Put<uint64_t>(r.data + 8, consumer_id);
  Put<uint32_t>(r.data + 16, device);
  Put<uint32_t>(r.data + 20, static_cast<uint32_t>(arrays.size()));
  Put<uint64_t>(r.data + kSequenceOffset, 0);  // set when the record joins its queue
  Put<uint32_t>(r.data + 32, static_cast<uint32_t>(header));
  Put<uint32_t>(r.data + 36, 0);  // reserved
  Put<uint64_t>(r.data + kRecordSizeOffset, size);
  uint8_t* at = r.data + kFixedHeaderBytes;
  size_t offset = header;
  for (const ArrayView& a : arrays) {
    Put<uint8_t>(at + 0, a.dtype);
    Put<uint16_t>(at + 2, static_cast<uint16_t>(a.dims.size()));
    Put<uint64_t>(at + 8, a.byte_size);
    for (size_t i = 0; i < a.dims.size(); ++i) Put<int64_t>(at + 16 + 8 * i, a.dims[i]);
    at += kDescriptorBytes + 8 * a.dims.size();
    offset = AlignUp(offset);
    if (a.byte_size > 0) std::memcpy(r.data + offset, a.data, a.byte_size);
    offset += a.byte_size;
  }
  if (offset < size) std::memset(r.data + offset, 0, size - offset);
  return r;
}

// ---- the queues ---------------------------------------------------------------------------

std::atomic<uint64_t> g_max_queue_bytes{256ull << 20};

struct QueueStats {
  uint64_t records_enqueued = 0, bytes_enqueued = 0;
  uint64_t records_delivered = 0, bytes_delivered = 0;
  uint64_t bytes_queued = 0, peak_bytes_queued = 0;
  uint64_t waits = 0, wait_ns = 0;
};

// One device's outfeed: a FIFO of records under a byte budget. Producers (device threads)
// wait while the budget is spent; a record larger than the whole budget waits for an empty
// queue and then goes in alone, so nothing is ever refused for its size or dropped.
class DeviceQueue {
 public:
  // Returns the record's sequence number, or -1 when the queue was closed (receiver stopped).
  int64_t Push(Record record) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!closed_ && !Fits(record.size)) {
      auto start = std::chrono::steady_clock::now();
      not_full_.wait(lock, [&] { return closed_ || Fits(record.size); });
      stats_.waits += 1;
      stats_.wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - start)
                            .count();
    }
    if (closed_) return -1;
    const uint64_t sequence = next_sequence_++;
    Put<uint64_t>(record.data + kSequenceOffset, sequence);
    records_.push_back(record);
    stats_.records_enqueued += 1;
    stats_.bytes_enqueued += record.size;
    stats_.bytes_queued += record.size;
    stats_.peak_bytes_queued = std::max(stats_.peak_bytes_queued, stats_.bytes_queued);
    lock.unlock();
    not_empty_.notify_one();
    return static_cast<int64_t>(sequence);
  }

  // Waits up to timeout_s for a record, then takes records up to the given limits (at least
  // one when any is queued). A closed queue still hands out what it holds.
  std::vector<Record> Pop(size_t max_records, size_t max_bytes, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    if (records_.empty() && !closed_ && timeout_s > 0) {
      not_empty_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                          [&] { return closed_ || !records_.empty(); });
    }
    std::vector<Record> out;
    size_t bytes = 0;
    while (!records_.empty() && out.size() < max_records && (out.empty() || bytes < max_bytes)) {
      out.push_back(records_.front());
      bytes += records_.front().size;
      records_.pop_front();
    }
    stats_.records_delivered += out.size();
    stats_.bytes_delivered += bytes;
    stats_.bytes_queued -= bytes;
    lock.unlock();
    if (!out.empty()) not_full_.notify_all();
    return out;
  }

  void SetClosed(bool closed) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = closed;
    }
    not_full_.notify_all();
    not_empty_.notify_all();
  }

  // Wakes producers waiting for room, so that a larger budget takes effect at once.
  void Poke() { not_full_.notify_all(); }

  QueueStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  bool Fits(size_t size) const {
    return stats_.bytes_queued == 0 ||
           stats_.bytes_queued + size <= g_max_queue_bytes.load(std::memory_order_relaxed);
  }

  std::mutex mu_;
  std::condition_variable not_empty_, not_full_;
  std::deque<Record> records_;
  uint64_t next_sequence_ = 0;
  bool closed_ = false;
  QueueStats stats_;
};

// Keyed by the ordinal XLA hands the handler: the device's global id (2048 and up on the
// second process of a multi-process CPU run), so a map rather than a table.
std::unordered_map<int, DeviceQueue*> g_queues;
std::mutex g_queues_mu;
bool g_closed = false;

DeviceQueue* QueueFor(int device) {
  if (device < 0) return nullptr;
  // Each device thread taps one device; queues are never freed, so the last lookup stays valid
  // and the hot path takes no lock.
  thread_local int cached_device = -1;
  thread_local DeviceQueue* cached_queue = nullptr;
  if (device == cached_device) return cached_queue;
  std::lock_guard<std::mutex> lock(g_queues_mu);
  DeviceQueue*& q = g_queues[device];
  if (q == nullptr) {
    q = new DeviceQueue();  // lives as long as the process: device threads may hold it
    if (g_closed) q->SetClosed(true);
  }
  cached_device = device;
  cached_queue = q;
  return q;
}

constexpr char kStoppedMessage[] =
    "hostcallback: the outfeed receiver was stopped (stop_outfeed_receiver()); "
    "taps cannot be delivered in this process any more";

// Why a record could not be enqueued, or the empty string when it was (then *sequence is set).
std::string Enqueue(int device, uint64_t consumer_id, const std::vector<ArrayView>& arrays,
                    uint16_t flags = 0, uint64_t* sequence = nullptr) {
  DeviceQueue* queue = QueueFor(device);
  if (queue == nullptr) return "hostcallback: negative device ordinal " + std::to_string(device);
  Record record = EncodeRecord(consumer_id, static_cast<uint32_t>(device), arrays, flags);
  if (record.data == nullptr) return "hostcallback: out of host memory for a tap record";
  const int64_t pushed = queue->Push(record);
  if (sequence != nullptr && pushed >= 0) *sequence = static_cast<uint64_t>(pushed);
  if (pushed < 0) {
    ReleaseRecord(record.data);
    return kStoppedMessage;
  }
  return "";
}

// ---- responses to `call` records ------------------------------------------------------------

struct Response {
  std::string error;  // empty: success
  std::vector<std::vector<uint8_t>> results;
};

// Where the receiver leaves the host's answer to a `call` record, keyed by (device, sequence),
// and where the device thread that sent the record waits for it.
class Responses {
 public:
  void Set(int device, uint64_t sequence, Response response) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_[{device, sequence}] = std::move(response);
    }
    cv_.notify_all();
  }

  // Why no answer came (stopped, timed out), or the empty string with *out set.
  std::string Wait(int device, uint64_t sequence, double timeout_s, Response* out) {
    std::unique_lock<std::mutex> lock(mu_);
    auto key = std::make_pair(device, sequence);
    auto answered = [&] { return closed_ || ready_.count(key) > 0; };
    if (timeout_s > 0) {
      if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), answered)) {
        abandoned_.insert(key);
        return "hostcallback: the host did not answer this call within its timeout of " +
               std::to_string(timeout_s) + " s";
      }
    } else {
      cv_.wait(lock, answered);
    }
    auto found = ready_.find(key);
    if (found == ready_.end()) return kStoppedMessage;
    *out = std::move(found->second);
    ready_.erase(found);
    return "";
  }

  // An answer nobody waits for any more (its call timed out) is dropped when it comes.
  bool Abandoned(int device, uint64_t sequence) {
    std::lock_guard<std::mutex> lock(mu_);
    return abandoned_.erase({device, sequence}) > 0;
  }

  void SetClosed(bool closed) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = closed;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int, uint64_t>, Response> ready_;
  std::set<std::pair<int, uint64_t>> abandoned_;
  bool closed_ = false;
};

Responses g_responses;

// Sends a call record and waits for the answer; fills *response or says why it could not.
std::string CallHost(int device, uint64_t consumer_id, const std::vector<ArrayView>& arrays,
                     double timeout_s, Response* response) {
  uint64_t sequence = 0;
  std::string problem = Enqueue(device, consumer_id, arrays, kFlagExpectsResponse, &sequence);
  if (!problem.empty()) return problem;
  return g_responses.Wait(device, sequence, timeout_s, response);
}

// ---- the FFI handlers ------------------------------------------------------------------------

// The arrays to send: every operand but the ordering token and the first skip_args others.
ffi::Error CollectArrays(ffi::RemainingArgs& args, int64_t skip_args, std::vector<ArrayView>* out) {
  out->reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> arg = args.get<ffi::AnyBuffer>(i);
    if (!arg.has_value()) return arg.error();
    ffi::AnyBuffer buffer = arg.value();
    if (buffer.element_type() == ffi::DataType::TOKEN) continue;
    if (skip_args > 0) {
      --skip_args;
      continue;
    }
    auto dims = buffer.dimensions();
    out->push_back(ArrayView{static_cast<uint8_t>(buffer.element_type()),
                             std::vector<int64_t>(dims.begin(), dims.end()),
                             buffer.untyped_data(), buffer.size_bytes()});
  }
  return ffi::Error::Success();
}

// emit_device >= 0: only that device enqueues (a whole-value tap lowered on every device).
ffi::Error TapImpl(int32_t device_ordinal, uint64_t consumer_id, int64_t emit_device,
                   ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)rets;  // only the ordering token, which carries no data
  if (emit_device != -1 && emit_device != device_ordinal) return ffi::Error::Success();
  std::vector<ArrayView> arrays;
  if (ffi::Error error = CollectArrays(args, 0, &arrays); error.failure()) return error;
  std::string problem = Enqueue(device_ordinal, consumer_id, arrays);
  if (!problem.empty()) return ffi::Error::Internal(problem);
  return ffi::Error::Success();
}

}  // namespace

// A `call`: send the arrays, wait for the host's results, copy them into the outputs.
// emit_device >= 0: only that device calls; the others return zeros (the lowering then takes the
// calling device's results to every device).
ffi::Error CallImpl(int32_t device_ordinal, uint64_t consumer_id, int64_t emit_device,
                    double timeout_s, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (emit_device != -1 && emit_device != device_ordinal) {
    for (size_t i = 0; i < rets.size(); ++i) {
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
      if (!ret.has_value()) return ret.error();
      ffi::AnyBuffer out = *ret.value();
      if (out.element_type() != ffi::DataType::TOKEN && out.size_bytes() > 0) {
        std::memset(out.untyped_data(), 0, out.size_bytes());
      }
    }
    return ffi::Error::Success();
  }
  std::vector<ArrayView> arrays;
  if (ffi::Error error = CollectArrays(args, 0, &arrays); error.failure()) return error;
  Response response;
  std::string problem = CallHost(device_ordinal, consumer_id, arrays, timeout_s, &response);
  if (problem.empty()) problem = response.error;
  if (!problem.empty()) return ffi::Error::Internal(problem);
  size_t next = 0;
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
    if (!ret.has_value()) return ret.error();
    ffi::AnyBuffer out = *ret.value();
    if (out.element_type() == ffi::DataType::TOKEN) continue;
    if (next >= response.results.size() || response.results[next].size() != out.size_bytes()) {
      return ffi::Error::Internal("hostcallback: the host's answer does not match the call's "
                                  "result shapes");
    }
    if (out.size_bytes() > 0) std::memcpy(out.untyped_data(), response.results[next].data(),
                                          out.size_bytes());
    ++next;
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackCall, CallImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("consumer_id")
                                  .Attr<int64_t>("emit_device")
                                  .Attr<double>("timeout_s")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackTap, TapImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("consumer_id")
                                  .Attr<int64_t>("emit_device")
                                  .RemainingArgs()
                                  .RemainingRets());

// ---- the Python module ------------------------------------------------------------------------

namespace {

using ByteArray = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>;
using ReadOnlyBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

DeviceQueue& CheckedQueue(int device) {
  DeviceQueue* queue = QueueFor(device);
  if (queue == nullptr) throw nb::value_error("device ordinal must not be negative");
  return *queue;
}

nb::list Drain(int device, size_t max_records, size_t max_bytes, double timeout_s) {
  DeviceQueue& queue = CheckedQueue(device);
  std::vector<Record> records;
  {
    nb::gil_scoped_release release;
    records = queue.Pop(max_records, max_bytes, timeout_s);
  }
  nb::list out;
  for (Record& r : records) {
    nb::capsule owner(r.data, [](void* p) noexcept { ReleaseRecord(static_cast<uint8_t*>(p)); });
    size_t shape[1] = {r.size};
    out.append(ByteArray(r.data, 1, shape, owner));
  }
  return out;
}

// The callback transport's way in: the same record, built from host arrays.
using HostLeaves = std::vector<std::tuple<int, std::vector<int64_t>, ReadOnlyBytes>>;

std::vector<ArrayView> ViewsOf(const HostLeaves& leaves) {
  std::vector<ArrayView> arrays;
  for (const auto& [dtype, dims, bytes] : leaves) {
    arrays.push_back(ArrayView{static_cast<uint8_t>(dtype), dims, bytes.data(), bytes.size()});
  }
  return arrays;
}

void EnqueueFromHost(int device, uint64_t consumer_id, const HostLeaves& leaves) {
  std::vector<ArrayView> arrays = ViewsOf(leaves);
  std::string problem;
  {
    nb::gil_scoped_release release;
    problem = Enqueue(device, consumer_id, arrays);
  }
  if (!problem.empty()) throw std::runtime_error(problem);
}

// The callback transport's `call`: the same record and wait, from the device's Python callback.
nb::list CallFromHost(int device, uint64_t consumer_id, const HostLeaves& leaves,
                      double timeout_s) {
  std::vector<ArrayView> arrays = ViewsOf(leaves);
  Response response;
  std::string problem;
  {
    nb::gil_scoped_release release;
    problem = CallHost(device, consumer_id, arrays, timeout_s, &response);
  }
  if (problem.empty()) problem = response.error;
  if (!problem.empty()) throw std::runtime_error(problem);
  nb::list out;
  for (const std::vector<uint8_t>& result : response.results) {
    out.append(nb::bytes(reinterpret_cast<const char*>(result.data()), result.size()));
  }
  return out;
}

void Respond(int device, uint64_t sequence, const std::vector<ReadOnlyBytes>& results) {
  Response response;
  for (const ReadOnlyBytes& result : results) {
    response.results.emplace_back(result.data(), result.data() + result.size());
  }
  if (!g_responses.Abandoned(device, sequence)) g_responses.Set(device, sequence, std::move(response));
}

void RespondError(int device, uint64_t sequence, const std::string& message) {
  Response response;
  response.error = message.empty() ? "hostcallback: the call failed on the host" : message;
  if (!g_responses.Abandoned(device, sequence)) g_responses.Set(device, sequence, std::move(response));
}

nb::dict StatsOf(int device) {
  QueueStats s = CheckedQueue(device).Stats();
  nb::dict d;
  d["records_enqueued"] = s.records_enqueued;
  d["bytes_enqueued"] = s.bytes_enqueued;
  d["records_delivered"] = s.records_delivered;
  d["bytes_delivered"] = s.bytes_delivered;
  d["bytes_queued"] = s.bytes_queued;
  d["peak_bytes_queued"] = s.peak_bytes_queued;
  d["waits"] = s.waits;
  d["wait_seconds"] = static_cast<double>(s.wait_ns) * 1e-9;
  return d;
}

void SetAllClosed(bool closed) {
  std::lock_guard<std::mutex> lock(g_queues_mu);
  g_closed = closed;
  for (auto& [device, q] : g_queues) q->SetClosed(closed);
  g_responses.SetClosed(closed);  // calls still waiting for an answer fail instead of hanging
}

void SetMaxQueueBytes(uint64_t n) {
  if (n == 0) throw nb::value_error("max_queue_bytes must be positive");
  g_max_queue_bytes.store(n);
  std::lock_guard<std::mutex> lock(g_queues_mu);
  for (auto& [device, q] : g_queues) q->Poke();
}

}  // namespace

NB_MODULE(_hostcallback_outfeed, m) {
  m.doc() = "hostcallback's native outfeed queues and XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["hostcallback_tap"] = nb::capsule(reinterpret_cast<void*>(HostcallbackTap));
    d["hostcallback_call"] = nb::capsule(reinterpret_cast<void*>(HostcallbackCall));
    return d;
  });
  m.def("drain", &Drain, nb::arg("device"), nb::arg("max_records"), nb::arg("max_bytes"),
        nb::arg("timeout_s"),
        "Waits (GIL released) up to timeout_s for records of one device; returns a list of "
        "uint8 arrays, one a record, each owning its memory.");
  m.def("enqueue", &EnqueueFromHost, nb::arg("device"), nb::arg("consumer_id"), nb::arg("leaves"),
        "Appends one record built from (dtype_code, dims, bytes) leaves; waits while the queue is full.");
  m.def("call", &CallFromHost, nb::arg("device"), nb::arg("consumer_id"), nb::arg("leaves"),
        nb::arg("timeout_s"),
        "Enqueues a call record and waits (GIL released) for the host's answer: a list of bytes.");
  m.def("respond", &Respond, nb::arg("device"), nb::arg("sequence"), nb::arg("results"),
        "The receiver's answer to a call record: one uint8 array per result leaf.");
  m.def("respond_error", &RespondError, nb::arg("device"), nb::arg("sequence"), nb::arg("message"),
        "Fails the waiting call with this message.");
  m.def("stats", &StatsOf, nb::arg("device"));
  m.def("set_closed", &SetAllClosed, nb::arg("closed"),
        "Closed queues refuse new records and wake every waiter; what they hold can still be drained.");
  m.def("set_max_queue_bytes", &SetMaxQueueBytes, nb::arg("max_queue_bytes"));
  m.def("max_queue_bytes", []() { return g_max_queue_bytes.load(); });
  m.attr("WIRE_VERSION") = kVersion;
}
