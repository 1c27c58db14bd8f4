// Meets the parts of a shared call (shared_calls.h). No Python.

#include "shared_calls.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "interrupts.h"
#include "timeouts.h"

namespace hostcallback {

namespace {

std::string PartsMissingMessage(size_t here, size_t parts, double waited_s) {
  char text[512];
  std::snprintf(text, sizeof(text),
                "hostcallback: only %zu of the %zu devices of a sharded computation reached this "
                "call within %g s, so the host was not called. XLA's CPU client had not started "
                "the other devices' parts of the computation (it runs at most 32 computations "
                "per device, and a call function's JAX work or the next steps may hold them): "
                "call jax.block_until_ready on each step's result",
                here, parts, waited_s);
  return text;
}

std::string InterruptedMessage(const std::string& interrupted) {
  return "hostcallback: the call was " + interrupted + " while it waited for the host's answer";
}

}  // namespace

uint64_t SharedCalls::NextOccurrence(int64_t run_id, uint64_t consumer_id, int device) {
  // Under mu_. A part of a run still calling after kRunsKept newer (run, call, device) triples
  // restarts at 0: it then meets no other part and fails after its patience, never taking
  // another occurrence's answer (that one has been taken by then).
  const auto part = std::make_tuple(run_id, consumer_id, device);
  auto [found, made] = occurrences_.try_emplace(part, 0);
  if (made) {
    occurrence_order_.push_back(part);
    if (occurrence_order_.size() > kRunsKept) {
      occurrences_.erase(occurrence_order_.front());
      occurrence_order_.pop_front();
    }
  }
  return found->second++;
}

void SharedCalls::Decide(const Key& key, Call& call, std::string error, Response answer) {
  call.decided = true;
  call.error = std::move(error);
  call.answer = std::move(answer);
  if (!call.calling) call.shards.clear();  // the host will not be called: nothing reads them
  decided_.push_back(key);
  while (decided_.size() > kDecidedKept) {  // calls some part of which never came
    auto old = calls_.find(decided_.front());
    decided_.pop_front();
    if (old == calls_.end() || &old->second == &call) continue;
    if (old->second.inside == 0) {
      calls_.erase(old);
    } else {
      old->second.forgotten = true;  // its last part inside erases it
    }
  }
  cv_.notify_all();
}

std::string SharedCalls::Join(int64_t run_id, uint64_t consumer_id, int device, int emit_device,
                              size_t parts, double timeout_s, ArrayViews shard,
                              const HostCaller& call_host, const AnswerTaker& take_answer) {
  using Seconds = std::chrono::duration<double>;
  std::vector<OwnedArray> own;  // copied: the calling part reads it after this part has left
  own.reserve(shard.size());
  for (const ArrayView& view : shard) {
    const auto* bytes = static_cast<const uint8_t*>(view.data);
    own.push_back({view.dtype, std::vector<int64_t>(view.dims, view.dims + view.ndim),
                   std::vector<uint8_t>(bytes, bytes + view.byte_size)});
  }
  const bool forever = WaitsForever(timeout_s);
  // The parts wait for each other this long, then for the host what is left of timeout_s: both
  // from the first part's arrival.
  const double patience =
      forever ? kPartsPatienceSeconds : std::min(timeout_s, kPartsPatienceSeconds);
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{run_id, consumer_id, NextOccurrence(run_id, consumer_id, device)};
  auto [entry, made] = calls_.try_emplace(key);
  Call& call = entry->second;  // map nodes stay put while others come and go
  if (made) {
    call.parts = parts;
    call.started = Clock::now();
  }
  ++call.inside;
  if (!call.decided) {
    call.shards[device] = std::move(own);
    cv_.notify_all();
  }
  auto left_of = [&](double limit_s) {  // > 0: a spent limit must not mean "forever"
    return std::max(limit_s - Seconds(Clock::now() - call.started).count(), kAtOnceSeconds);
  };
  std::string interrupted;
  auto all_here = [&] { return call.decided || call.shards.size() >= call.parts; };
  if (!WaitInterruptibly(cv_, lock, left_of(patience), all_here, &interrupted) ||
      !interrupted.empty()) {
    if (!call.decided) {
      Decide(key, call,
             interrupted.empty() ? PartsMissingMessage(call.shards.size(), call.parts, patience)
                                 : InterruptedMessage(interrupted),
             {});
    }
  }
  if (!call.decided && device == emit_device) {  // every part is here: call the host
    std::vector<ArrayView> views;
    for (const auto& [part_device, arrays] : call.shards) {
      for (const OwnedArray& array : arrays) {
        views.push_back({array.dtype, array.dims.data(), array.dims.size(), array.bytes.data(),
                         array.bytes.size()});
      }
    }
    call.calling = true;
    const double host_timeout = forever ? timeout_s : left_of(timeout_s);
    lock.unlock();
    Response answer;
    std::string why = call_host(ArrayViews(views), host_timeout, &answer);
    if (why.empty()) why = answer.error;
    lock.lock();
    call.calling = false;
    call.shards.clear();
    if (!call.decided) Decide(key, call, std::move(why), std::move(answer));
  } else if (!call.decided) {  // every part is here: wait for the calling part's outcome
    auto decided = [&] { return call.decided; };
    if (!WaitInterruptibly(cv_, lock, forever ? timeout_s : left_of(timeout_s), decided,
                           &interrupted) ||
        !interrupted.empty()) {
      if (!call.decided) {
        Decide(key, call,
               interrupted.empty() ? TimeoutMessage(timeout_s) : InterruptedMessage(interrupted),
               {});
      }
    }
  }
  std::string outcome = call.error.empty() ? take_answer(call.answer) : call.error;
  --call.inside;
  ++call.taken;
  if (call.inside == 0 && (call.taken == call.parts || call.forgotten)) calls_.erase(entry);
  return outcome;
}

size_t SharedCalls::Open() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t open = 0;
  for (const auto& [key, call] : calls_) open += call.decided ? 0 : 1;
  return open;
}

SharedCalls& g_shared_calls = *new SharedCalls();

}  // namespace hostcallback
