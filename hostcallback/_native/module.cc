// The Python module _hostcallback_outfeed: checks what Python passes, releases the GIL where the
// core waits, and binds every function and constant Python sees (_hostcallback_outfeed.pyi).
//
// The core as a whole is the device side of hostcallback: per-device outfeed queues and the XLA
// FFI handlers. A handler runs on XLA's device thread. It copies the tapped buffers into one
// record (header + payload, layout in docs/wire-format.md and hostcallback/_records/wire.py) and
// appends it to that device's queue. It never runs Python and never takes the GIL. The receiver
// threads in Python call drain(), which waits here with the GIL released, gathers a batch, and
// decodes it here: each record comes out as (consumer id, device, sequence, flags, arrays), the
// arrays read-only numpy views of the record's memory (no copy), barrier markers apart. Deciding
// what to do with a record (which consumer, pytrees, errors, barriers) lives in Python.
//
// One job a file, each header stating the contract its .cc keeps:
//   constants.h          what C++ and Python share: wire numbers, a drained record's fields,
//                        "all devices", the platform
//   record.{h,cc}        one record's bytes and how they are encoded
//   buffer_pool.{h,cc}   where record buffers come from and go back to; the memory bound
//   timeouts.{h,cc}      what a timeout means; the message of a call that ran out of it
//   computations.{h,cc}  the tapped computations running on a device (begin to fence)
//   device_queue.{h,cc}  one queue per (platform, device), the table of them, Enqueue;
//                        what its receiver has handled
//   responses.{h,cc}     the answers to calls, and sending a call to wait for one
//   shared_calls.{h,cc}  a call shared by the devices of a sharded computation, met in the handler
//   ffi_handlers.{h,cc}  the CPU's XLA FFI handlers (tap, call, shared call, order point,
//                        check, begin, fence)
//   ffi_arrays.h         the tapped arrays of an FFI call, for every handler
//   cuda_tap.{h,cc}      the GPU tap: copies and an event queued on the device's stream
//   cuda_commit.{h,cc}   a GPU device's committer: its taps' records join their queue once
//                        their copies are done
//   cuda_driver.{h,cc}   the CUDA driver entry points the GPU tap uses, found at run time
//   pinned_pool.{h,cc}   page-locked record buffers for the GPU tap
//   numpy_api.{h,cc}     the one NumPy C API table of the extension
//   numpy_records.{h,cc} drained records as numpy views; host arrays on their way in
//   gil.h                releasing the GIL safely while the interpreter may be finalizing
//   exit_gate.{h,cc}     where receiver threads park once exit has delivered what it could
//   interrupts.{h,cc}    Ctrl-C while the main thread waits for the host
//   spin_wait.h          a short wait that stays awake before it sleeps, within its timeout
//   module.cc            this file
//
// Rules every file keeps (docs/reliability.md):
// - No C++ exception crosses the FFI boundary or the nanobind boundary unhandled; a record is
//   never lost or leaked on the way out of drain().
// - Global state is allocated once and never destroyed: XLA's device threads may still run
//   while the interpreter exits, after static destructors would have run.
// - Queues are keyed by (platform, device id): ids repeat across platforms.

#include "numpy_api.h"  // first: before any other NumPy header

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "buffer_pool.h"
#include "constants.h"
#include "cuda_tap.h"
#include "device_queue.h"
#include "exit_gate.h"
#include "ffi_handlers.h"
#include "gil.h"
#include "interrupts.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "numpy_records.h"
#include "pinned_pool.h"
#include "record.h"
#include "responses.h"
#include "shared_calls.h"
#include "timeouts.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace hostcallback {
namespace {

DeviceQueue* CheckedQueue(const std::string& platform, int device) {
  if (device < 0) throw nb::value_error("device ordinal must not be negative");
  if (platform.empty()) throw nb::value_error("platform must name a JAX platform, e.g. 'cpu'");
  return LookUpQueue(platform, device);
}

// A drain's waiting windows (coalesce_s, linger_s) are bounded: 0 to 1 second.
void CheckWindow(const char* name, double seconds) {
  if (std::isnan(seconds) || seconds < 0 || seconds > 1) {
    throw nb::value_error((std::string(name) + " must be between 0 and 1 second").c_str());
  }
}

// Waits with the GIL released (DeviceQueue::Pop), then hands the records out undecoded
// (RawRecords).
nb::list DrainRaw(int device, size_t max_records, size_t max_bytes, double timeout_s,
                  const std::string& platform) {
  if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) throw nb::value_error(bad.c_str());
  DeviceQueue* queue = CheckedQueue(platform, device);
  // A batch in Python counts toward the memory bound: never more than one budget of bytes.
  max_bytes = std::min<uint64_t>(max_bytes, g_max_queue_bytes.load());
  std::vector<Record> records;
  {
    GilReleased released;
    ReturnReleased();
    records = queue->Pop(max_records, max_bytes, timeout_s);
  }
  return RawRecords(records);
}

// Waits like drain_raw(), then decodes in C++ (DecodeRecords): (records, markers).
nb::tuple Drain(int device, size_t max_records, size_t max_bytes, double timeout_s,
                const std::string& platform, double coalesce_s, double linger_s) {
  if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) throw nb::value_error(bad.c_str());
  CheckWindow("coalesce_s", coalesce_s);
  CheckWindow("linger_s", linger_s);
  DeviceQueue* queue = CheckedQueue(platform, device);
  LoadDtypes();  // before any record leaves the queue
  max_bytes = std::min<uint64_t>(max_bytes, g_max_queue_bytes.load());
  g_batch_bytes.store(max_bytes, std::memory_order_relaxed);
  // Markers an earlier drain took and could not hand out come first, and without waiting.
  std::vector<uint64_t> markers = queue->TakeKeptMarkers();
  const bool at_once = !markers.empty();
  std::vector<Record> records;
  {
    GilReleased released;
    ReturnReleased();
    records = queue->Pop(max_records, max_bytes, at_once ? kAtOnceSeconds : timeout_s,
                         at_once ? 0 : coalesce_s, at_once ? 0 : linger_s);
  }
  try {
    return DecodeRecords(records, markers);
  } catch (...) {
    queue->KeepMarkers(markers);
    throw;
  }
}

// The callback transport's tap: the same record, from the device's Python callback.
// flags and held_bytes: those of a tap handed over in Python (EnqueueHandedOver).
void EnqueueFromPython(int device, uint64_t consumer_id, const HostLeaves& leaves,
                       const std::string& platform, uint16_t flags, uint64_t held_bytes) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  std::vector<ArrayView> arrays = ViewsOf(leaves);
  int64_t pushed;
  {
    GilReleased released;
    FlushOwnReleases();
    pushed = Enqueue(queue, device, consumer_id, arrays, flags, 0, nullptr, held_bytes);
  }
  if (pushed < 0 && pushed != DeviceQueue::kDroppedAtExit) {
    throw std::runtime_error(WhyNotEnqueued(queue, pushed, 0));
  }
}

void EnqueueFromHost(int device, uint64_t consumer_id, const HostLeaves& leaves,
                     const std::string& platform) {
  EnqueueFromPython(device, consumer_id, leaves, platform, 0, 0);
}

// A tap handed over in Python (kFlagHandedOverInPython): the leaves are its ticket,
// hostcallback/_records/handover.py holds its arrays, and the budget counts their held_bytes.
void EnqueueHandedOver(int device, uint64_t consumer_id, const HostLeaves& leaves,
                       uint64_t held_bytes, const std::string& platform) {
  EnqueueFromPython(device, consumer_id, leaves, platform, kFlagHandedOverInPython, held_bytes);
}

// The two steps a GPU tap joins its queue in (DeviceQueue::Reserve, then Commit from the stream's
// host function), taken from the host so that tests drive them where no GPU is.
void ReserveFromHost(int device, uint64_t bytes, const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  int64_t reserved;
  {
    GilReleased released;
    reserved = queue->Reserve(bytes);
  }
  if (reserved < 0) throw std::runtime_error(WhyNotEnqueued(queue, reserved, 0));
}

int64_t CommitFromHost(int device, uint64_t consumer_id, const HostLeaves& leaves,
                       uint64_t reserved, const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  std::vector<ArrayView> arrays = ViewsOf(leaves);
  Record record = EncodeRecord(consumer_id, static_cast<uint32_t>(device), arrays);
  int64_t joined = DeviceQueue::kClosed;
  try {
    joined = queue->Commit(record, reserved);
  } catch (...) {
    ReleaseRecord(record);
    throw;
  }
  if (joined < 0) {
    ReleaseRecord(record);
    throw std::runtime_error(queue->ClosedReason());
  }
  return joined;
}

// A uint8 array that owns the bytes, so a large answer reaches Python without another copy.
nb::object OwningArray(std::vector<uint8_t>&& bytes) {
  auto* owned = new std::vector<uint8_t>(std::move(bytes));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
  size_t shape[1] = {owned->size()};
  return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(owned->data(), 1, shape, owner));
}

// A call from the device's Python callback: the same record and wait (GIL released); throws
// why it failed.
Response CallFromPython(int device, uint64_t consumer_id, const HostLeaves& leaves,
                        double timeout_s, const std::string& platform, uint16_t flags) {
  if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) throw nb::value_error(bad.c_str());
  DeviceQueue* queue = CheckedQueue(platform, device);
  std::vector<ArrayView> arrays = ViewsOf(leaves);
  Response response;
  std::string problem;
  {
    GilReleased released;
    FlushOwnReleases();
    problem = CallHost(queue, device, consumer_id, arrays, timeout_s, &response, flags);
  }
  if (problem.empty()) problem = response.error;
  if (!problem.empty()) throw std::runtime_error(problem);
  return response;
}

// The callback transport's `call`, answered in bytes: one uint8 array per result leaf.
nb::list CallFromHost(int device, uint64_t consumer_id, const HostLeaves& leaves, double timeout_s,
                      const std::string& platform) {
  Response response =
      CallFromPython(device, consumer_id, leaves, timeout_s, platform, kFlagExpectsResponse);
  nb::list out;
  for (std::vector<uint8_t>& result : response.results) {
    out.append(OwningArray(std::move(result)));
  }
  return out;
}

// The callback transport's `call`, handed over in Python (kFlagHandedOverInPython): the leaves
// are the call's ticket, and hostcallback/_records/handover.py holds the answer under it.
void CallHandedOver(int device, uint64_t consumer_id, const HostLeaves& leaves, double timeout_s,
                    const std::string& platform) {
  CallFromPython(device, consumer_id, leaves, timeout_s, platform,
                 kFlagExpectsResponse | kFlagHandedOverInPython);
}

bool Respond(int device, uint64_t sequence, const std::vector<ReadOnlyBytes>& results,
             const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  Response response;
  for (const ReadOnlyBytes& result : results) {
    response.results.emplace_back(result.data(), result.data() + result.size());
  }
  return g_responses.Set({queue, sequence}, std::move(response));
}

void RespondError(int device, uint64_t sequence, const std::string& message,
                  const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  Response response;
  response.error = message.empty() ? "hostcallback: the call failed on the host" : message;
  g_responses.Set({queue, sequence}, std::move(response));
}

nb::dict StatsOf(int device, const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  QueueStats s = queue->Stats();
  auto [calls_waiting, answers_unclaimed] = g_responses.Counts(queue);
  nb::dict d;
  d["records_enqueued"] = s.records_enqueued;
  d["bytes_enqueued"] = s.bytes_enqueued;
  d["records_delivered"] = s.records_delivered;
  d["barrier_markers_enqueued"] = s.markers_enqueued;
  d["barrier_markers_delivered"] = s.markers_delivered;
  d["bytes_delivered"] = s.bytes_delivered;
  d["bytes_queued"] = s.bytes_queued;
  d["peak_bytes_queued"] = s.peak_bytes_queued;
  d["bytes_reserved"] = s.bytes_reserved;
  d["waits"] = s.waits;
  d["wait_seconds"] = static_cast<double>(s.wait_ns) * 1e-9;
  d["producers_waiting"] = s.producers_waiting;
  d["batches"] = s.batches;
  d["receiver_wakeups"] = s.receiver_wakeups;
  d["receivers_waiting"] = s.receivers_waiting;
  d["fences_waiting"] = s.fences_waiting;
  d["fence_waits"] = s.fence_waits;
  d["fence_wait_seconds"] = static_cast<double>(s.fence_wait_ns) * 1e-9;
  d["fences_released"] = s.fences_released;
  d["calls_waiting"] = calls_waiting;
  d["answers_unclaimed"] = answers_unclaimed;
  return d;
}

// Waits (GIL released) until the device's receiver has handled every record enqueued so far:
// "handled", "stopped", "failed", "timed out" or "own receiver" (called while delivering).
std::string AwaitHandledFromPython(int device, double timeout_s, const std::string& platform) {
  if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) throw nb::value_error(bad.c_str());
  DeviceQueue* queue = CheckedQueue(platform, device);
  DeviceQueue::Handled handled;
  {
    GilReleased released;
    handled = queue->WaitHandled(timeout_s);
  }
  switch (handled) {
    case DeviceQueue::Handled::kYes: return "handled";
    case DeviceQueue::Handled::kStopped: return "stopped";
    case DeviceQueue::Handled::kFailed: return "failed";
    case DeviceQueue::Handled::kTimedOut: return "timed out";
    case DeviceQueue::Handled::kOwnReceiver: return "own receiver";
    case DeviceQueue::Handled::kReleased: return "released";
    case DeviceQueue::Handled::kInterrupted: return "interrupted";
    case DeviceQueue::Handled::kForked: return "forked";
  }
  return "handled";
}

// The portable mode's tap from a Python callback: waits (GIL released) for the device's taps as
// a fence does (DeviceQueue::AwaitTaps); the same words as await_handled.
std::string AwaitTapsFromPython(int device, const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  DeviceQueue::Handled handled;
  {
    GilReleased released;
    handled = queue->AwaitTaps(kTapPatienceSeconds);
  }
  return WhyTapsNotHandled(queue, handled);
}

nb::dict ComputationsOf(int device, const std::string& platform) {
  const ComputationsNow now = CheckedQueue(platform, device)->computations.Now();
  nb::dict d;
  d["begun"] = now.begun;
  d["oldest_running"] = now.oldest_running;
  d["running"] = now.running;
  d["seconds_since_end"] = now.seconds_since_end;
  return d;
}

void ResetPeak(int device, const std::string& platform) {
  CheckedQueue(platform, device)->ResetPeak();
}

void FailQueue(int device, const std::string& reason, const std::string& platform) {
  DeviceQueue* queue = CheckedQueue(platform, device);
  queue->Fail(reason);
  g_responses.Fail(queue, reason);
}

void SetMaxQueueBytes(uint64_t n) {
  if (n == 0) throw nb::value_error("max_queue_bytes must be positive");
  SetQueueBudget(n);
}

// Built into Python objects after the pool's lock (BufferPool::Stats): making them may run the
// garbage collector, which may free a record's arrays and so return buffers to the pool.
nb::dict PoolStatsDict() {
  FlushOwnReleases();  // this thread's released records count as pooled
  const PoolStats s = g_pool.Stats();
  nb::dict d;
  d["pooled_bytes"] = s.pooled_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["records_held"] = s.records_held;
  return d;
}

void DefineModule(nb::module_& m) {
  m.doc() = "hostcallback's native outfeed queues and XLA FFI handlers";
  if (!ImportNumpyApi()) throw nb::python_error();
  pthread_atfork(nullptr, nullptr, NoteForkedChild);
  pthread_atfork(nullptr, nullptr, ResetExitGateInChild);
  RememberMainThread(nb::cast<unsigned long>(
      nb::module_::import_("threading").attr("main_thread")().attr("ident")));
  ShareExitGate(CoreExitGate());
  m.def("mark_receiver_thread", &MarkReceiverThread,
        "Marks the calling thread as a receiver: it parks at the exit gate once that is closed.");
  m.def("close_exit_gate", &CloseExitGate, nb::arg("timeout_s"),
        "Closes the exit gate (at the end of exit's handler) and waits at most timeout_s for "
        "the receiver threads past it to have the GIL; False if one still had not.");
  m.def(
      "exit_gate",
      []() { return nb::capsule(static_cast<const void*>(CoreExitGate()), kExitGateCapsule); },
      "The exit gate, for an add-on's extension to share (its share_exit_gate).");
  m.def("registrations", []() {
    nb::dict d;
    d["hostcallback_tap"] = nb::capsule(reinterpret_cast<void*>(HostcallbackTap));
    d["hostcallback_call"] = nb::capsule(reinterpret_cast<void*>(HostcallbackCall));
    d["hostcallback_order"] = nb::capsule(reinterpret_cast<void*>(HostcallbackOrder));
    d["hostcallback_shared_call"] = nb::capsule(reinterpret_cast<void*>(HostcallbackSharedCall));
    d["hostcallback_check"] = nb::capsule(reinterpret_cast<void*>(HostcallbackCheck));
    d["hostcallback_tap_handled"] = nb::capsule(reinterpret_cast<void*>(HostcallbackTapHandled));
    d["hostcallback_begin"] = nb::capsule(reinterpret_cast<void*>(HostcallbackBegin));
    d["hostcallback_fence"] = nb::capsule(reinterpret_cast<void*>(HostcallbackFence));
    return d;
  });
  m.def(
      "cuda_registrations",
      []() {
        nb::dict d;
        d["hostcallback_tap"] = nb::capsule(reinterpret_cast<void*>(HostcallbackTapCuda));
        d["hostcallback_begin"] = nb::capsule(reinterpret_cast<void*>(HostcallbackBeginCuda));
        d["hostcallback_fence"] = nb::capsule(reinterpret_cast<void*>(HostcallbackFenceCuda));
        return d;
      },
      "The handlers to register for the CUDA platform: the GPU tap, and a tapped computation's "
      "begin and fence (cuda_tap.cc).");
  m.def("set_cuda_device_ids", &SetCudaDeviceIds, nb::arg("ids"),
        "The global Device.id of each local CUDA device ordinal, in ordinal order.");
  m.def(
      "pinned_stats",
      []() {
        PinnedStats s = g_pinned_pool.Stats();
        nb::dict d;
        d["pinned_bytes"] = s.pinned_bytes;
        d["in_use_bytes"] = s.in_use_bytes;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        d["pageable_fallbacks"] = s.pageable_fallbacks;
        return d;
      },
      "The GPU taps' page-locked buffers: bytes held and in use, reuse, and records that took "
      "pageable memory because the pinned allowance (twice the queue budget, at most a quarter "
      "of the machine's memory) was spent.");
  m.def("drain", &Drain, nb::arg("device"), nb::arg("max_records"), nb::arg("max_bytes"),
        nb::arg("timeout_s"), nb::arg("platform") = kNativePlatform, nb::arg("coalesce_s") = 0.0,
        nb::arg("linger_s") = 0.0,
        "Waits (GIL released) up to timeout_s (0 or inf: forever) for records of one device, "
        "then up to coalesce_s more for a fuller batch (not when a call or barrier marker is "
        "queued, nor after such a wait gathered nothing until a burst comes); while records "
        "come less than linger_s apart, first up to linger_s for the next ones without their "
        "producers waking it; returns (records, markers): records as (consumer_id, device, "
        "sequence, flags, (read-only zero-copy numpy arrays)) in queue order, markers as the "
        "values of the batch's barrier markers. max_bytes is capped at the queue budget.");
  m.def("drain_raw", &DrainRaw, nb::arg("device"), nb::arg("max_records"), nb::arg("max_bytes"),
        nb::arg("timeout_s"), nb::arg("platform") = kNativePlatform,
        "Like drain, undecoded: a list of read-only uint8 arrays, one a record, each owning its "
        "memory (for hostcallback._records.wire.decode_record, the reference decoder).");
  m.def("enqueue", &EnqueueFromHost, nb::arg("device"), nb::arg("consumer_id"), nb::arg("leaves"),
        nb::arg("platform") = kNativePlatform,
        "Appends one record built from (dtype_code, dims, bytes) leaves; waits while the queue "
        "is full.");
  m.def("enqueue_handed_over", &EnqueueHandedOver, nb::arg("device"), nb::arg("consumer_id"),
        nb::arg("leaves"), nb::arg("held_bytes"), nb::arg("platform") = kNativePlatform,
        "As enqueue, for a tap whose leaves are its ticket and whose arrays, held_bytes of them, "
        "wait in Python under that ticket (FLAG_HANDED_OVER_IN_PYTHON, "
        "hostcallback._records.handover); "
        "the queue's budget counts them until the record is drained.");
  m.def("reserve", &ReserveFromHost, nb::arg("device"), nb::arg("bytes"),
        nb::arg("platform") = kNativePlatform,
        "Holds room for bytes in the queue's budget, waiting (GIL released) in line while it is "
        "spent, as a GPU tap does at launch; raises when the queue is closed.");
  m.def("commit", &CommitFromHost, nb::arg("device"), nb::arg("consumer_id"), nb::arg("leaves"),
        nb::arg("reserved"), nb::arg("platform") = kNativePlatform,
        "Joins a record built from leaves under a reservation of `reserved` bytes, without "
        "waiting, as a GPU tap's host function does; returns its sequence number, or raises "
        "(the room given back) when the queue was closed meanwhile.");
  m.def(
      "cancel_reservation",
      [](int device, uint64_t bytes, const std::string& platform) {
        CheckedQueue(platform, device)->CancelReservation(bytes);
      },
      nb::arg("device"), nb::arg("bytes"), nb::arg("platform") = kNativePlatform,
      "Gives back room a reservation held, unused.");
  m.attr("CALL_TIMEOUT_PREFIX") = kTimeoutPrefix;
  m.attr("CALL_FAILED_ELSEWHERE") = kCallFailedElsewhere;
  m.def(
      "keep_call_failure",
      [](uint64_t consumer_id, const std::string& reason) {
        return g_call_failures.Keep(consumer_id, reason);
      },
      nb::arg("consumer_id"), nb::arg("reason"),
      "Keeps why a shared call failed (the callback transport's calling device) under a new "
      "failure id, the call's failure flag: never 0.");
  m.def(
      "call_failure_reason",
      [](uint64_t consumer_id, uint32_t failure_id) {
        return g_call_failures.Reason(consumer_id, failure_id);
      },
      nb::arg("consumer_id"), nb::arg("failure_id"),
      "Why the shared call failed under that id (its check on every device), or "
      "CALL_FAILED_ELSEWHERE where it failed in another process.");
  m.def("call_host", &CallFromHost, nb::arg("device"), nb::arg("consumer_id"), nb::arg("leaves"),
        nb::arg("timeout_s"), nb::arg("platform") = kNativePlatform,
        "Enqueues a call record and waits (GIL released) for the host's answer: one uint8 array "
        "per result leaf, owning its bytes.");
  m.def("call_host_handed_over", &CallHandedOver, nb::arg("device"), nb::arg("consumer_id"),
        nb::arg("leaves"), nb::arg("timeout_s"), nb::arg("platform") = kNativePlatform,
        "As call_host, for a call whose leaves are its ticket and whose answer the receiver hands "
        "over in Python, under that ticket (FLAG_HANDED_OVER_IN_PYTHON, "
        "hostcallback._records.handover); "
        "returns once it is there.");
  m.def("respond", &Respond, nb::arg("device"), nb::arg("sequence"), nb::arg("results"),
        nb::arg("platform") = kNativePlatform,
        "The receiver's answer to a call record: one uint8 array per result leaf. True if the "
        "call still waited for it, False if it was dropped (the call timed out or was stopped).");
  m.def(
      "call_waiting",
      [](int device, uint64_t sequence, const std::string& platform) {
        return g_responses.Waiting({CheckedQueue(platform, device), sequence});
      },
      nb::arg("device"), nb::arg("sequence"), nb::arg("platform") = kNativePlatform,
      "Whether the call record's caller still waits for its answer (it may have timed out).");
  m.def("respond_error", &RespondError, nb::arg("device"), nb::arg("sequence"), nb::arg("message"),
        nb::arg("platform") = kNativePlatform, "Fails the waiting call with this message.");
  m.def("stats", &StatsOf, nb::arg("device"), nb::arg("platform") = kNativePlatform);
  m.def("await_handled", &AwaitHandledFromPython, nb::arg("device"), nb::arg("timeout_s"),
        nb::arg("platform") = kNativePlatform,
        "Waits (GIL released) up to timeout_s (0 or inf: forever) until the device's receiver has "
        "handled every record enqueued so far; returns 'handled', 'stopped', 'failed', "
        "'timed out' or 'own receiver' (called on that receiver while it delivers: no wait).");
  m.def("await_taps", &AwaitTapsFromPython, nb::arg("device"),
        nb::arg("platform") = kNativePlatform,
        "Waits (GIL released) as a fence does until the device's receiver has handled every tap "
        "enqueued so far, or has been stuck in one batch for 5 s; returns why the queue failed, "
        "or '' .");
  m.def("computation_failed", &EndFailedOnThisThread,
        "Called on XLA's thread by a host callback of ours that fails its computation: the "
        "tapped computation this thread runs ends now (its fence will not run).");
  m.def(
      "abandon_computations",
      [](int device, uint64_t before_id, const std::string& platform) {
        return CheckedQueue(platform, device)->computations.Abandon(before_id);
      },
      nb::arg("device"), nb::arg("before_id"), nb::arg("platform") = kNativePlatform,
      "Forgets the computations begun before before_id that are still running (they failed "
      "where no handler of ours saw it); returns how many.");
  m.def(
      "fail_tap_computation",
      [](int device, uint64_t sequence, const std::string& why, const std::string& platform) {
        DeviceQueue* queue = CheckedQueue(platform, device);
        const uint64_t computation = queue->ComputationOf(sequence);
        if (computation != kNoComputation) queue->computations.FailRunning(computation, why);
      },
      nb::arg("device"), nb::arg("sequence"), nb::arg("why"), nb::arg("platform") = kNativePlatform,
      "A tap that fails its computation failed (its record's sequence number): the computation "
      "that made it, if it still runs, fails with the reason at its fence (the first, if "
      "several); if that is not known (a record from long ago, or from another thread), none.");
  m.def("computations", &ComputationsOf, nb::arg("device"), nb::arg("platform") = kNativePlatform,
        "The tapped computations of one device: begun (ids handed out), oldest_running (begun "
        "when none runs), running, seconds_since_end (-1 before the first ends).");
  m.def(
      "shared_calls_kept", []() { return g_shared_calls.Open(); },
      "Calls shared by a sharded jit's devices kept now: waiting for a part or the host, or "
      "for a part to take the outcome (0 once every call's parts came and left).");
  m.def("reset_peak_bytes_queued", &ResetPeak, nb::arg("device"),
        nb::arg("platform") = kNativePlatform,
        "Starts peak_bytes_queued again from what is queued now.");
  m.def("set_closed", &SetAllClosed, nb::arg("closed"),
        "Closed queues refuse new records and wake every waiter; what they hold can still be "
        "drained.");
  m.def("fail", &FailQueue, nb::arg("device"), nb::arg("reason"),
        nb::arg("platform") = kNativePlatform,
        "Its receiver is gone: every waiting and future tap or call on this queue fails with the "
        "reason; what it holds can still be drained.");
  m.def("set_exiting", &SetExiting,
        "Interpreter exit has given up waiting: from now on a tap that finds its queue closed "
        "is dropped and counted (dropped_at_exit) instead of failing its computation.");
  m.def("dropped_at_exit", &DroppedAtExit);
  m.def(
      "interrupt_calls", [] { g_responses.InterruptCalls(); },
      "The program was ended by a Ctrl-C and exits: every waiting and future call fails at "
      "once, so that computations of calls end; taps are still delivered.");
  m.def("set_leaving", &SetLeaving,
        "Exit was told to leave at once (a Ctrl-C): from now on a tap that finds its queue "
        "closed fails its computation, so that XLA stops running it.");
  m.def("seconds_since_interrupt", &SecondsSinceInterrupt,
        "Seconds since the last SIGINT (Ctrl-C) the handler watch_interrupts() put in place saw; "
        "-1 before the first.");
  m.def("watch_interrupts", &WatchInterrupts,
        "Puts a SIGINT handler in front of Python's (where Python handles SIGINT and it is not "
        "there yet) so that Ctrl-C ends a wait of the main thread for the host at once.");
  m.def("set_max_queue_bytes", &SetMaxQueueBytes, nb::arg("max_queue_bytes"));
  m.def("max_queue_bytes", []() { return g_max_queue_bytes.load(); });
  m.def(
      "pooled_bytes", []() { return g_pool.PooledBytes(); },
      "Bytes of free record buffers kept for reuse.");
  m.def("pool_stats", &PoolStatsDict,
        "The buffer pool: pooled_bytes (free), in_use_bytes, hits and misses, records_held. "
        "in_use_bytes includes small records a receiver released since its last drain.");
  // The constants Python shares with the core (constants.h): Python reads them from here.
  m.attr("NATIVE_PLATFORM") = kNativePlatform;
  nb::dict wire_dtypes;
  for (const WireDtype& dtype : kWireDtypes) wire_dtypes[nb::int_(dtype.code)] = dtype.name;
  m.attr("WIRE_DTYPES") = wire_dtypes;
  // The XLA FFI API of the headers the core was built against: a jaxlib registers its handlers
  // only if it speaks this major version and at least this minor one (ffi_api.py checks first).
  m.attr("FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("WIRE_VERSION") = kVersion;
  m.attr("WIRE_MAGIC") = kMagic;
  m.attr("WIRE_ALIGNMENT") = kAlignment;
  m.attr("WIRE_FIXED_HEADER_BYTES") = kFixedHeaderBytes;
  m.attr("WIRE_DESCRIPTOR_BYTES") = kDescriptorBytes;
  m.attr("WIRE_MAX_NDIM") = kMaxNdim;
  m.attr("FLAG_EXPECTS_RESPONSE") = kFlagExpectsResponse;
  m.attr("FLAG_HANDED_OVER_IN_PYTHON") = kFlagHandedOverInPython;
  m.attr("BARRIER_MARKER_ID") = kBarrierMarkerId;
  m.attr("ALL_DEVICES") = kAllDevices;
  m.attr("RECORD_CONSUMER_ID") = kRecordConsumerId;
  m.attr("RECORD_DEVICE_ID") = kRecordDeviceId;
  m.attr("RECORD_SEQUENCE") = kRecordSequence;
  m.attr("RECORD_FLAGS") = kRecordFlags;
  m.attr("RECORD_LEAVES") = kRecordLeaves;
}

}  // namespace
}  // namespace hostcallback

NB_MODULE(_hostcallback_outfeed, m) { hostcallback::DefineModule(m); }
