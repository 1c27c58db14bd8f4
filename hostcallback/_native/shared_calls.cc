// Meets the parts of a shared call (shared_calls.h). No Python.

#include "shared_calls.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <utility>

#include "device_queue.h"
#include "interrupts.h"
#include "timeouts.h"

namespace hostcallback {

namespace {

// How long a part spins for the others, and then for the outcome, before it sleeps
// (spin_wait.h): a sharded io_callback took 212 us a call sleeping at once, 49 to 61 spinning.
constexpr std::chrono::microseconds kPartSpin{50};

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

uint64_t SharedCalls::NextOccurrence(int64_t run_id, uint64_t site, int device) {
  // Under mu_. A part unused while kPartsKept others were used restarts at 0: it then meets no
  // other part and fails after its patience, never taking another occurrence's answer.
  const Part part{run_id, site, device};
  auto found = occurrences_.find(part);
  if (found != occurrences_.end()) {
    recent_parts_.splice(recent_parts_.end(), recent_parts_, found->second.second);
    return found->second.first++;
  }
  recent_parts_.push_back(part);
  occurrences_.emplace(part, std::make_pair(uint64_t{1}, std::prev(recent_parts_.end())));
  if (recent_parts_.size() > kPartsKept) {
    occurrences_.erase(recent_parts_.front());
    recent_parts_.pop_front();
  }
  return 0;
}

void SharedCalls::Decide(const Key& key, Call& call, std::string error, Response answer) {
  call.decided = true;
  if (!error.empty()) {
    const auto run_call = std::make_pair(std::get<0>(key), std::get<1>(key));
    if (failures_.emplace(run_call, error).second) failure_order_.push_back(run_call);
    if (failure_order_.size() > kFailuresKept) {
      failures_.erase(failure_order_.front());
      failure_order_.pop_front();
    }
  }
  call.error = std::move(error);
  call.answer = std::move(answer);
  if (!call.calling) call.shards.clear();  // the host will not be called: nothing reads them
  decided_.emplace_back(key, call.generation);
  while (decided_.size() > kDecidedKept) {  // calls some part of which never came
    auto [old_key, generation] = decided_.front();
    decided_.pop_front();
    auto old = calls_.find(old_key);
    // Gone, or a later call of the same key (a part restarted its count): not this one.
    if (old == calls_.end() || old->second.generation != generation || &old->second == &call) {
      continue;
    }
    if (old->second.inside == 0) {
      calls_.erase(old);
    } else {
      old->second.forgotten = true;  // its last part inside erases it
    }
  }
  changes_.Bump();
  cv_.notify_all();
}

std::string SharedCalls::Join(int64_t run_id, uint64_t site, int device, int emit_device,
                              size_t parts, double timeout_s, ArrayViews shard,
                              const HostCaller& call_host, const AnswerTaker& take_answer) {
  using Seconds = std::chrono::duration<double>;
  if (InForkedChild()) return kForkedMessage;  // taking no lock (device_queue.h)
  const bool forever = WaitsForever(timeout_s);
  // The parts wait for each other this long, then for the host what is left of timeout_s: both
  // from the first part's arrival.
  const double patience =
      forever ? kPartsPatienceSeconds : std::min(timeout_s, kPartsPatienceSeconds);
  std::unique_lock<std::mutex> lock(mu_);
  const Key key{run_id, site, NextOccurrence(run_id, site, device)};
  auto [entry, made] = calls_.try_emplace(key);
  Call& call = entry->second;  // map nodes stay put while others come and go
  if (made) {
    call.parts = parts;
    call.started = Clock::now();
    call.generation = ++generations_;
    // A part of a call that failed and was dropped since: the same outcome, at once.
    auto failed = failures_.find({run_id, site});
    if (failed != failures_.end()) Decide(key, call, failed->second, {});
  }
  ++call.inside;
  if (!call.decided) {
    // Views of this part's operands: it stays here while the calling part may read them.
    call.shards[device].assign(shard.begin(), shard.end());
    changes_.Bump();
    cv_.notify_all();
  }
  auto left_of = [&](double limit_s) {  // > 0: a spent limit must not mean "forever"
    return std::max(limit_s - Seconds(Clock::now() - call.started).count(), kAtOnceSeconds);
  };
  // 1. Every part waits until all have come, or the outcome is decided without them.
  std::string interrupted;
  auto all_here = [&] { return call.decided || call.shards.size() >= call.parts; };
  // The others are usually microseconds away.
  SpinUnlocked(lock, changes_, SpinWithin(kPartSpin, left_of(patience)), all_here);
  if (!WaitInterruptibly(cv_, lock, left_of(patience), all_here, &interrupted) ||
      !interrupted.empty()) {
    if (!call.decided && !call.calling) {
      Decide(key, call,
             interrupted.empty() ? PartsMissingMessage(call.shards.size(), call.parts, patience)
                                 : InterruptedMessage(interrupted),
             {});
    }
  }
  // 2. The calling part calls the host with every shard, in device order, within what is left
  // of the timeout, and decides. The others wait for that: the host call reads their operands.
  if (!call.decided && device == emit_device) {
    std::vector<ArrayView> views;
    for (const auto& [part_device, arrays] : call.shards) {
      views.insert(views.end(), arrays.begin(), arrays.end());
    }
    call.calling = true;
    const double host_timeout = forever ? timeout_s : left_of(timeout_s);
    lock.unlock();
    Response answer;
    std::string why;
    try {
      why = call_host(ArrayViews(views), host_timeout, &answer);
      if (why.empty()) why = answer.error;
      // The host had what was left of the timeout; the message names the whole of it.
      if (why.rfind(kTimeoutPrefix, 0) == 0) why = TimeoutMessage(timeout_s);
    } catch (const std::bad_alloc&) {  // the others must not wait for an outcome never decided
      why = "hostcallback: out of host memory for a call record";
    } catch (const std::exception& e) {
      why = std::string("hostcallback: ") + e.what();
    }
    lock.lock();
    call.calling = false;
    changes_.Bump();
    call.shards.clear();
    if (!call.decided) Decide(key, call, std::move(why), std::move(answer));
  } else {
    auto decided = [&] { return call.decided && !call.calling; };
    SpinUnlocked(lock, changes_, kPartSpin, decided);
    cv_.wait(lock, decided);
  }
  // 3. Every part takes the same outcome; the answer is copied out with the lock released (the
  // call stays while a part is inside, and its outcome no longer changes).
  std::string outcome = call.error;
  const Response& answer = call.answer;
  lock.unlock();
  if (outcome.empty()) {
    try {
      outcome = take_answer(answer);
    } catch (const std::exception& e) {
      outcome = std::string("hostcallback: ") + e.what();
    }
  }
  lock.lock();
  --call.inside;
  ++call.taken;
  if (call.inside == 0 && (call.taken == call.parts || call.forgotten)) calls_.erase(entry);
  return outcome;
}

size_t SharedCalls::Open() {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.size();
}

SharedCalls& g_shared_calls = *new SharedCalls();

}  // namespace hostcallback
