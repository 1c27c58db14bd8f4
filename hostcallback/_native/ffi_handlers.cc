// The XLA FFI handlers: on XLA's device thread, a tap enqueues one record, a call sends one and
// copies the host's answer into its outputs, a shared call meets the other devices' parts
// (shared_calls.h), a check fails a summed call on every device at once.
// Each handler is a short function (its Impl) plus one XLA_FFI_DEFINE_HANDLER_SYMBOL binding that
// reads like its signature. No Python, no GIL.
//
// These are the CPU handlers (kNativePlatform): their operands are host memory. The GPU tap is
// cuda_tap.cc's: the same record and queues, its copies queued on the device's stream.

#include "ffi_handlers.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "constants.h"
#include "device_queue.h"
#include "ffi_arrays.h"
#include "record.h"
#include "responses.h"
#include "shared_calls.h"
#include "timeouts.h"
#include "xla/ffi/api/ffi.h"

namespace hostcallback {

namespace ffi = xla::ffi;

namespace {

// Which computation a failing handler ends, since its fence will not run: the one of the
// handler's XLA execution on its device where it knows both, else the innermost one its thread
// began (computations.h). The begin and the fence (which ends its computation itself) end none.
struct Ends {
  bool computation = true;
  int32_t device = -1;
  int64_t run_id = kUnknownRun;
};
constexpr Ends kEndsNone{false};

void EndFailed(const Ends& ends) noexcept {
  try {
    RunningComputations* computations = nullptr;
    if (ends.device >= 0 && ends.run_id != kUnknownRun) {
      computations = &NativeQueueFor(ends.device)->computations;
    }
    EndFailedRun(computations, ends.run_id);
  } catch (...) {  // out of memory for the device's queue: a barrier takes it for failed later
  }
}

// Every handler's body runs inside this: a C++ exception (bad_alloc for a record larger than
// memory) becomes an FFI error that fails the computation with the reason, never a crash.
// An error fails the computation, whose fence then never runs: it ends here (`ends`).
template <typename Body>
ffi::Error Guarded(Ends ends, Body body) noexcept {
  ffi::Error error = ffi::Error::Success();
  try {
    error = body();
  } catch (const std::bad_alloc&) {
    error = ffi::Error::Internal("hostcallback: out of host memory for a tap record");
  } catch (const std::exception& e) {
    error = ffi::Error::Internal(std::string("hostcallback: ") + e.what());
  } catch (...) {
    error = ffi::Error::Internal("hostcallback: unknown C++ exception in the tap handler");
  }
  if (error.failure() && ends.computation) EndFailed(ends);
  return error;
}

constexpr size_t kArraysOnStack = 16;

// Waits until the device's receiver has handled every tap enqueued so far (see AwaitTaps);
// fails only when the receiver died (a stopped one waits no longer).
ffi::Error AwaitTapsHandled(DeviceQueue* queue) {
  const std::string why = WhyTapsNotHandled(queue, queue->AwaitTaps(kTapPatienceSeconds));
  return why.empty() ? ffi::Error::Success() : ffi::Error::Internal(why);
}

// emit_device >= 0: only that device enqueues (a whole-value tap lowered on every device).
// kAwaitHandled: the tap returns once its record has been handled (the portable mode's taps,
// which have no fence at the end of their computation).
template <bool kAwaitHandled>
ffi::Error TapImpl(int32_t device_ordinal, ffi::RunId run, ffi::ThreadPool pool,
                   uint64_t consumer_id, int64_t emit_device, ffi::RemainingArgs args,
                   ffi::RemainingRets rets) {
  (void)rets;  // only the ordering token, which carries no data
  return Guarded(Ends{true, device_ordinal, run.run_id}, [&]() -> ffi::Error {
    if (emit_device != kAllDevices && emit_device != device_ordinal) return ffi::Error::Success();
    if (device_ordinal < 0) {
      return ffi::Error::Internal("hostcallback: negative device ordinal " +
                                  std::to_string(device_ordinal));
    }
    // On the stack for all but the widest taps: a tap allocates nothing but its record.
    ArrayView on_stack[kArraysOnStack];
    std::vector<ArrayView> on_heap;
    ArrayView* views = on_stack;
    if (args.size() > kArraysOnStack) {
      on_heap.resize(args.size());
      views = on_heap.data();
    }
    size_t count = 0;
    if (ffi::Error error = CollectArrays(args, views, &count); error.failure()) return error;
    DeviceQueue* queue = NativeQueueFor(device_ordinal);
    const int64_t pushed =
        Enqueue(queue, device_ordinal, consumer_id, ArrayViews(views, count), 0, 0, &pool,
                /*held_bytes=*/0, run.run_id);
    if (pushed == DeviceQueue::kDroppedAtExit) return ffi::Error::Success();
    if (pushed < 0) return ffi::Error::Internal(WhyNotEnqueued(queue, pushed, 0));
    if (kAwaitHandled) return AwaitTapsHandled(queue);
    return ffi::Error::Success();
  });
}

// The start of a tapped computation, before its taps (the token it returns starts their chain):
// hands out the computation's id (its low 32 bits) for the fence to end it with. The execution's
// id tells its taps' records which computation made them, on whatever thread XLA runs them.
ffi::Error BeginImpl(int32_t device_ordinal, ffi::RunId run, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  (void)args;  // only the token that orders it
  return Guarded(kEndsNone, [&]() -> ffi::Error {
    uint32_t id = 0;
    if (device_ordinal >= 0) {
      DeviceQueue* queue = NativeQueueFor(device_ordinal);
      id = static_cast<uint32_t>(queue->computations.Begin(run.run_id));
    }
    for (size_t i = 0; i < rets.size(); ++i) {
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
      if (!ret.has_value()) return ret.error();
      ffi::AnyBuffer out = *ret.value();
      if (out.element_type() == ffi::DataType::U32) std::memcpy(out.untyped_data(), &id, 4);
    }
    return ffi::Error::Success();
  });
}

// The end of a tapped computation, after its taps (their tokens): waits until the device's
// receiver has handled every tap enqueued so far, so that the computation's results are ready
// only once its taps were handled; then ends the computation its begin's id names.
ffi::Error FenceImpl(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)rets;  // only a token
  return Guarded(kEndsNone, [&]() -> ffi::Error {
    if (device_ordinal < 0) return ffi::Error::Success();
    DeviceQueue* queue = NativeQueueFor(device_ordinal);
    bool has_id = false;
    uint32_t id = 0;
    for (size_t i = 0; i < args.size() && !has_id; ++i) {
      ffi::ErrorOr<ffi::AnyBuffer> arg = args.get<ffi::AnyBuffer>(i);
      if (!arg.has_value()) return arg.error();
      if (arg.value().element_type() != ffi::DataType::U32) continue;
      std::memcpy(&id, arg.value().untyped_data(), sizeof(id));
      has_id = true;  // (the first uint32 operand; the weight follows it)
    }
    ffi::Error handled = AwaitTapsHandled(queue);
    if (!has_id) return handled;
    // A tap that fails its computation (RunningComputations::FailRunning) failed meanwhile.
    const std::string failure = queue->computations.End(id);
    if (handled.success() && !failure.empty()) return ffi::Error::Internal(failure);
    return handled;
  });
}

// Zeros in every output but the token.
ffi::Error ZeroOutputs(ffi::RemainingRets& rets) {
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

// Copies the host's answer into the first `outputs` results (tokens skipped), one array each,
// every array of the answer placed; returns why not.
std::string CopyAnswer(const Response& response, ffi::RemainingRets& rets, size_t outputs) {
  constexpr char kMismatch[] =
      "hostcallback: the host's answer does not match the call's result shapes";
  size_t next = 0;
  for (size_t i = 0; i < outputs; ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
    if (!ret.has_value()) return "hostcallback: " + ret.error().message();
    ffi::AnyBuffer out = *ret.value();
    if (out.element_type() == ffi::DataType::TOKEN) continue;
    if (next >= response.results.size() || response.results[next].size() != out.size_bytes()) {
      return kMismatch;
    }
    if (out.size_bytes() > 0) {
      std::memcpy(out.untyped_data(), response.results[next].data(), out.size_bytes());
    }
    ++next;
  }
  return next == response.results.size() ? "" : kMismatch;
}

// A shared call that timed out is said on stderr at once: where its devices share the answer in
// an XLA collective (the callback transport, several processes) and XLA's CPU client left a
// device out of it, XLA ends the process after its own rendezvous limit (40 s) before the error
// reaches Python.
void ReportSharedTimeout(const std::string& problem) {
  std::fprintf(stderr,
               "%s (a call shared over the devices of a sharded computation; every "
               "device fails with this error)\n",
               problem.c_str());
  std::fflush(stderr);
}

// A `call`: send the arrays, wait for the host's results, copy them into the outputs.
// emit_device != kAllDevices (a call shared over the devices of a sharded computation): only
// that device calls and the others return zeros; the last output is a uint32 failure flag. The
// calling device must not fail on its own, since the others wait for it in the collective that
// shares its results: it returns zeros with its failure id as the flag and leaves the reason for
// HostcallbackCheck, which fails every device together after the collective.
ffi::Error CallImpl(int32_t device_ordinal, ffi::RunId run, ffi::ThreadPool pool,
                    uint64_t consumer_id, int64_t emit_device, double timeout_s,
                    ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Guarded(Ends{true, device_ordinal, run.run_id}, [&]() -> ffi::Error {
    const bool shared = emit_device != kAllDevices;
    if (shared && emit_device != device_ordinal) return ZeroOutputs(rets);
    std::string problem;
    Response response;
    if (device_ordinal < 0) {
      problem = "hostcallback: negative device ordinal " + std::to_string(device_ordinal);
    } else if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) {
      problem = "hostcallback: " + bad;
    } else {
      try {
        std::vector<ArrayView> arrays(args.size());  // in the try: a shared call must not throw
        size_t count = 0;
        if (ffi::Error error = CollectArrays(args, arrays.data(), &count); error.failure()) {
          problem = "hostcallback: " + error.message();
        } else {
          problem = CallHost(NativeQueueFor(device_ordinal), device_ordinal, consumer_id,
                             ArrayViews(arrays.data(), count), timeout_s, &response,
                             kFlagExpectsResponse, &pool);
          if (problem.empty()) problem = response.error;
        }
      } catch (const std::bad_alloc&) {
        if (!shared) throw;
        problem = "hostcallback: out of host memory for a call record";
      } catch (const std::exception& e) {
        if (!shared) throw;
        problem = std::string("hostcallback: ") + e.what();
      }
    }
    const size_t results = rets.size() - (shared ? 1 : 0);  // the flag comes last
    if (problem.empty()) problem = CopyAnswer(response, rets, results);
    if (!shared) {
      return problem.empty() ? ffi::Error::Success() : ffi::Error::Internal(problem);
    }
    uint32_t failed = 0;
    if (!problem.empty()) {
      if (problem.rfind(kTimeoutPrefix, 0) == 0) ReportSharedTimeout(problem);
      if (ffi::Error error = ZeroOutputs(rets); error.failure()) return error;
      failed = g_call_failures.Keep(consumer_id, problem);
    }
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> flag = rets.get<ffi::AnyBuffer>(rets.size() - 1);
    if (!flag.has_value()) return flag.error();
    std::memcpy((*flag.value()).untyped_data(), &failed, sizeof(failed));
    return ffi::Error::Success();
  });
}

// A call shared over the devices of a sharded computation in this process, met here rather than
// in XLA's collectives (shared_calls.h): each device's part joins with its own shard of the
// operands, emit_device's calls the host with all of them, and every part gets the same answer
// or error. ordinals: the devices that run the computation, in the order the host gets their
// shards; sends[p * operands + i]: whether the p-th sends operand i (one device of those that
// hold the same shard); name: the call function's, for errors; site: the call op's own id, the
// same in every device's part (the parts meet by it). The last output is a uint32 set to 1: even
// a call without results returns something, so that its part is kept.
ffi::Error SharedCallImpl(int32_t device_ordinal, ffi::RunId run, ffi::ThreadPool pool,
                          uint64_t consumer_id, int64_t emit_device,
                          ffi::Span<const int64_t> ordinals, ffi::Span<const int64_t> sends,
                          double timeout_s, std::string_view name, uint64_t site,
                          ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Guarded(Ends{true, device_ordinal, run.run_id}, [&]() -> ffi::Error {
    const size_t parts = ordinals.size();
    const auto own = std::find(ordinals.begin(), ordinals.end(), int64_t{device_ordinal});
    if (own == ordinals.end() || rets.size() < 2 ||
        std::find(ordinals.begin(), ordinals.end(), emit_device) == ordinals.end()) {
      return ffi::Error::Internal("hostcallback: a shared call of devices " +
                                  std::to_string(device_ordinal) + " and " +
                                  std::to_string(emit_device) + " that are not both its own");
    }
    if (std::string bad = CheckTimeout(timeout_s); !bad.empty()) {
      return ffi::Error::InvalidArgument("hostcallback: " + bad);
    }
    std::vector<ArrayView> operands(args.size());
    size_t count = 0;
    if (ffi::Error error = CollectArrays(args, operands.data(), &count); error.failure()) {
      return error;
    }
    if (sends.size() != parts * count) {
      return ffi::Error::Internal("hostcallback: a shared call's sends do not match its operands");
    }
    // Only the operands this device sends: another device sends a shard it holds as well.
    const size_t first = static_cast<size_t>(own - ordinals.begin()) * count;
    std::vector<ArrayView> arrays;
    for (size_t i = 0; i < count; ++i) {
      if (sends[first + i] != 0) arrays.push_back(operands[i]);
    }
    DeviceQueue* queue = NativeQueueFor(static_cast<int>(emit_device));
    auto call_host = [&](ArrayViews all, double left_s, Response* answer) {
      return CallHost(queue, static_cast<int>(emit_device), consumer_id, all, left_s, answer,
                      kFlagExpectsResponse, &pool);
    };
    auto take_answer = [&](const Response& answer) -> std::string {  // then a uint32 1
      if (std::string bad = CopyAnswer(answer, rets, rets.size() - 1); !bad.empty()) return bad;
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> kept = rets.get<ffi::AnyBuffer>(rets.size() - 1);
      const uint32_t one = 1;
      if (!kept.has_value() || (*kept.value()).size_bytes() != sizeof(one)) {
        return "hostcallback: the host's answer does not match the call's result shapes";
      }
      std::memcpy((*kept.value()).untyped_data(), &one, sizeof(one));
      return "";
    };
    std::string problem =
        g_shared_calls.Join(run.run_id, site, device_ordinal, static_cast<int>(emit_device), parts,
                            timeout_s, ArrayViews(arrays), call_host, take_answer);
    if (problem.empty()) return ffi::Error::Success();
    if (!name.empty() && problem.find(name) == std::string::npos) {
      problem += " (the call of " + std::string(name) + ")";
    }
    if (problem.rfind(kTimeoutPrefix, 0) == 0 && device_ordinal == emit_device) {
      ReportSharedTimeout(problem);
    }
    return ffi::Error::Internal(problem);
  });
}

// After a shared call's results and failure flags were summed over the devices: fails with the
// call's reason when any device failed, else passes its operands (the flag, then the values)
// through.
ffi::Error CheckImpl(int32_t device_ordinal, ffi::RunId run, uint64_t consumer_id,
                     ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Guarded(Ends{true, device_ordinal, run.run_id}, [&]() -> ffi::Error {
    ffi::ErrorOr<ffi::AnyBuffer> flag = args.get<ffi::AnyBuffer>(0);
    if (!flag.has_value()) return flag.error();
    uint32_t failed = 0;
    std::memcpy(&failed, flag.value().untyped_data(), sizeof(failed));
    if (failed != 0) return ffi::Error::Internal(g_call_failures.Reason(consumer_id, failed));
    for (size_t i = 0; i < rets.size(); ++i) {
      ffi::ErrorOr<ffi::AnyBuffer> in = args.get<ffi::AnyBuffer>(i);
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> ret = rets.get<ffi::AnyBuffer>(i);
      if (!in.has_value()) return in.error();
      if (!ret.has_value()) return ret.error();
      ffi::AnyBuffer out = *ret.value();
      if (out.size_bytes() != in.value().size_bytes()) {
        return ffi::Error::Internal("hostcallback: check operands and results differ");
      }
      if (out.size_bytes() > 0) {
        std::memcpy(out.untyped_data(), in.value().untyped_data(), out.size_bytes());
      }
    }
    return ffi::Error::Success();
  });
}

// A point in a computation's program order (a call shared over a sharded jit's devices is
// ordered by it): its results, the token and uint32 zeros, come after its operands.
ffi::Error OrderImpl(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  (void)args;  // only what it comes after
  return Guarded(Ends{}, [&]() { return ZeroOutputs(rets); });
}

// Both taps read the same signature.
auto TapBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::RunId>()
      .Ctx<ffi::ThreadPool>()
      .Attr<uint64_t>("consumer_id")
      .Attr<int64_t>("emit_device")
      .RemainingArgs()
      .RemainingRets();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackCall, CallImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<uint64_t>("consumer_id")
                                  .Attr<int64_t>("emit_device")
                                  .Attr<double>("timeout_s")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackSharedCall, SharedCallImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<uint64_t>("consumer_id")
                                  .Attr<int64_t>("emit_device")
                                  .Attr<ffi::Span<const int64_t>>("ordinals")
                                  .Attr<ffi::Span<const int64_t>>("sends")
                                  .Attr<double>("timeout_s")
                                  .Attr<std::string_view>("name")
                                  .Attr<uint64_t>("site")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackOrder, OrderImpl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackCheck, CheckImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Attr<uint64_t>("consumer_id")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackTap, TapImpl<false>, TapBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostcallbackTapHandled, TapImpl<true>, TapBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HostcallbackBegin, BeginImpl,
    ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Ctx<ffi::RunId>().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HostcallbackFence, FenceImpl,
    ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().RemainingArgs().RemainingRets());

}  // namespace hostcallback
