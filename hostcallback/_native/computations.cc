// Keeps the set of tapped computations running on a device (computations.h). No Python.

#include "computations.h"

namespace hostcallback {

namespace {
// The computations this thread began and has not ended, innermost last.
thread_local std::vector<std::pair<RunningComputations*, uint64_t>> t_running;

void Forget(RunningComputations* computations, uint32_t id_low_bits) {
  for (auto it = t_running.rbegin(); it != t_running.rend(); ++it) {
    if (it->first == computations && static_cast<uint32_t>(it->second) == id_low_bits) {
      t_running.erase(std::next(it).base());
      return;
    }
  }
}
}  // namespace

uint64_t RunningComputations::Begin(uint64_t delivering_batch) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    running_.emplace(id, delivering_batch);
  }
  t_running.emplace_back(this, id);
  return id;
}

void RunningComputations::End(uint32_t id_low_bits) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if (static_cast<uint32_t>(it->first) == id_low_bits) {
      running_.erase(it);
      break;
    }
  }
  last_end_ = std::chrono::steady_clock::now();
  ended_any_ = true;
  Forget(this, id_low_bits);
}

uint64_t RunningComputations::DeliveringAtBegin(uint32_t id_low_bits) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, batch] : running_) {
    if (static_cast<uint32_t>(id) == id_low_bits) return batch;
  }
  return 0;
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

void EndFailedOnThisThread() {
  if (t_running.empty()) return;
  auto [computations, id] = t_running.back();
  computations->End(static_cast<uint32_t>(id));
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

}  // namespace hostcallback
