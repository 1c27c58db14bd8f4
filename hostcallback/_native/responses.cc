// Keeps the table of answers to `call` records, and sends a call and waits for its answer.
// No Python.

#include "responses.h"

#include <algorithm>
#include <chrono>
#include <random>

#include "device_queue.h"
#include "interrupts.h"
#include "timeouts.h"

namespace hostcallback {

namespace {
// How long a call spins for its answer before it sleeps (measured: 20 to 200 us all gave a
// trivial call 7 to 10 us a round trip, against 57 us sleeping at once).
constexpr std::chrono::microseconds kAnswerSpin{50};
}  // namespace

void Responses::Expect(Key key) {
  std::lock_guard<std::mutex> lock(mu_);
  table_[key];
}

void Responses::Forget(Key key) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  table_.erase(key);
}

bool Responses::Set(Key key, Response response) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = table_.find(key);
    if (found == table_.end() || found->second.answered) return false;
    found->second.answered = true;
    found->second.response = std::move(response);
    changes_.Bump();
  }
  cv_.notify_all();
  return true;
}

bool Responses::Waiting(Key key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = table_.find(key);
  return found != table_.end() && !found->second.answered && !closed_ &&
         failed_.count(key.first) == 0;
}

std::string Responses::Wait(Key key, double timeout_s, Response* out, double call_timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto entry = table_.find(key);  // map iterators stay valid while others come and go
  if (entry == table_.end()) return StoppedReason();
  auto answered = [&] {
    return closed_ || calls_interrupted_ || entry->second.answered || failed_.count(key.first) > 0;
  };
  // The receiver answers a small call within microseconds: see spin_wait.h.
  const auto start = std::chrono::steady_clock::now();
  SpinUnlocked(lock, changes_, SpinWithin(kAnswerSpin, timeout_s), answered);
  double left = timeout_s;
  if (!WaitsForever(timeout_s)) {  // > 0: a spent timeout must not mean "forever"
    const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - start;
    left = std::max(timeout_s - spent.count(), kAtOnceSeconds);
  }
  std::string interrupted;
  WaitInterruptibly(cv_, lock, left, answered, &interrupted);
  // A handler that raised ends the call even if its answer came meanwhile: the interruption
  // is what the computation must see, not the next call's.
  const bool got = entry->second.answered && interrupted.empty();
  if (got) *out = std::move(entry->second.response);
  table_.erase(entry);
  if (got) return "";
  if (!interrupted.empty()) {
    return "hostcallback: the call was " + interrupted + " while it waited for the host's answer";
  }
  if (auto failed = failed_.find(key.first); failed != failed_.end()) return failed->second;
  if (calls_interrupted_) return kInterruptedMessage;
  if (closed_) return StoppedReason();
  return TimeoutMessage(call_timeout_s);
}

std::pair<uint64_t, uint64_t> Responses::Counts(const DeviceQueue* queue) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t waiting = 0, unclaimed = 0;
  for (const auto& [key, entry] : table_) {
    if (key.first != queue) continue;
    (entry.answered ? unclaimed : waiting) += 1;
  }
  return {waiting, unclaimed};
}

void Responses::SetClosed(bool closed) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = closed;
    changes_.Bump();
  }
  cv_.notify_all();
}

void Responses::InterruptCalls() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls_interrupted_.store(true);
    changes_.Bump();
  }
  cv_.notify_all();
  InterruptCallsWaitingForRoom();
}

bool Responses::CallsInterrupted() const { return calls_interrupted_.load(); }

void Responses::Fail(const DeviceQueue* queue, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed_[queue] = reason;
    changes_.Bump();
  }
  cv_.notify_all();
}

Responses& g_responses = *new Responses();

CallFailures::CallFailures() : next_id_(static_cast<uint32_t>(std::random_device{}())) {}

uint32_t CallFailures::Keep(uint64_t consumer_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t id = next_id_++;
  if (id == 0) id = next_id_++;  // 0 is "no failure"
  reasons_[{consumer_id, id}] = reason;
  order_.push_back({consumer_id, id});
  if (order_.size() > kKept) {
    reasons_.erase(order_.front());
    order_.pop_front();
  }
  return id;
}

std::string CallFailures::Reason(uint64_t consumer_id, uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = reasons_.find({consumer_id, id});
  return found != reasons_.end() ? found->second : kCallFailedElsewhere;
}

CallFailures& g_call_failures = *new CallFailures();

std::string CallHost(DeviceQueue* queue, int device, uint64_t consumer_id, ArrayViews arrays,
                     double timeout_s, Response* response, uint16_t flags,
                     xla::ffi::ThreadPool* pool) {
  if (g_responses.CallsInterrupted()) return Responses::kInterruptedMessage;
  // One timeout for the whole call: waiting for room in the queue, then for the answer.
  const auto start = std::chrono::steady_clock::now();
  const int64_t pushed = Enqueue(queue, device, consumer_id, arrays, flags, timeout_s, pool);
  if (pushed == DeviceQueue::kInterrupted && g_responses.CallsInterrupted()) {
    return Responses::kInterruptedMessage;
  }
  if (pushed < 0) return WhyNotEnqueued(queue, pushed, timeout_s);
  double left = timeout_s;
  if (!WaitsForever(timeout_s)) {
    const double spent =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    left = std::max(timeout_s - spent, 1e-6);  // > 0: a spent timeout must not mean "forever"
  }
  return g_responses.Wait({queue, static_cast<uint64_t>(pushed)}, left, response, timeout_s);
}

}  // namespace hostcallback
