// Keeps the set of tapped computations running on a device (computations.h). No Python.

#include "computations.h"

#include <algorithm>
#include <string>
#include <utility>

namespace hostcallback {

namespace {
// The computations this thread began, innermost last (some may have ended on other threads).
thread_local std::vector<std::pair<RunningComputations*, uint64_t>> t_running;

void Forget(RunningComputations* computations, uint32_t id_low_bits) {
  for (auto it = t_running.rbegin(); it != t_running.rend(); ++it) {
    if (it->first == computations && static_cast<uint32_t>(it->second) == id_low_bits) {
      t_running.erase(std::next(it).base());
      return;
    }
  }
}

// Drops this thread's entries of computations that ended elsewhere or were abandoned.
void Prune() {
  t_running.erase(
      std::remove_if(t_running.begin(), t_running.end(),
                     [](const auto& entry) { return !entry.first->IsRunning(entry.second); }),
      t_running.end());
}
}  // namespace

uint64_t RunningComputations::Begin(int64_t run_id) {
  Prune();
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    running_.emplace(id, Running{run_id, std::string()});
  }
  t_running.emplace_back(this, id);
  return id;
}

bool RunningComputations::IsRunning(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  return running_.count(id) > 0;
}

uint64_t RunningComputations::OfRun(int64_t run_id, bool* unsure) {
  if (unsure != nullptr) *unsure = run_id == kUnknownRun;
  if (run_id == kUnknownRun) return kNoComputation;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t found = kNoComputation;
  for (const auto& [id, running] : running_) {
    if (running.run_id != run_id) continue;
    if (found != kNoComputation) {
      if (unsure != nullptr) *unsure = true;
      return kNoComputation;
    }
    found = id;
  }
  return found;
}

std::string RunningComputations::End(uint32_t id_low_bits) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string failure;
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if (static_cast<uint32_t>(it->first) == id_low_bits) {
      failure = std::move(it->second.why);
      running_.erase(it);
      break;
    }
  }
  last_end_ = std::chrono::steady_clock::now();
  ended_any_ = true;
  Forget(this, id_low_bits);
  return failure;
}

size_t RunningComputations::Abandon(uint64_t before_id) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t abandoned = 0;
  while (!running_.empty() && running_.begin()->first < before_id) {
    running_.erase(running_.begin());
    abandoned += 1;
  }
  return abandoned;
}

ComputationsNow RunningComputations::Now() {
  std::lock_guard<std::mutex> lock(mu_);
  ComputationsNow now;
  now.begun = next_id_;
  now.oldest_running = running_.empty() ? next_id_ : running_.begin()->first;
  now.running = running_.size();
  if (ended_any_) {
    now.seconds_since_end =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_end_).count();
  }
  return now;
}

uint64_t RunningComputations::CurrentOnThisThread() {
  for (auto it = t_running.rbegin(); it != t_running.rend(); ++it) {
    if (it->first == this) return it->second;
  }
  return kNoComputation;
}

void RunningComputations::FailRunning(uint64_t id, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = running_.find(id);
  if (found != running_.end() && found->second.why.empty()) found->second.why = why;
}

void EndFailedOnThisThread() {
  Prune();
  if (t_running.empty()) return;
  auto [computations, id] = t_running.back();
  computations->End(static_cast<uint32_t>(id));
}

void EndFailedRun(RunningComputations* computations, int64_t run_id) {
  bool unsure = true;
  const uint64_t id =
      computations == nullptr ? kNoComputation : computations->OfRun(run_id, &unsure);
  if (id != kNoComputation) {
    computations->End(static_cast<uint32_t>(id));
  } else if (unsure) {
    EndFailedOnThisThread();
  }
}

}  // namespace hostcallback
