#include "exit_gate.h"

#include <Python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace hostcallback {
namespace {

struct GateState {
  std::mutex mu;
  std::condition_variable none_passing;
  bool closed = false;
  int passing = 0;  // receiver threads between enter() and entered()
};

// Never destroyed: threads may use it at exit. Replaced (the old one leaked) in a fork child.
std::atomic<GateState*> g_state{new GateState()};

GateState& State() { return *g_state.load(std::memory_order_acquire); }

thread_local bool t_is_receiver = false;

bool Enter() {
  if (!t_is_receiver) return true;
  GateState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.closed) return false;
  ++state.passing;
  return true;
}

void Entered() {
  if (!t_is_receiver) return;
  GateState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  if (--state.passing == 0) state.none_passing.notify_all();
}

const ExitGate kGate{&Enter, &Entered};

}  // namespace

const ExitGate* CoreExitGate() { return &kGate; }

void MarkReceiverThread() { t_is_receiver = true; }

void ResetExitGateInChild() {
  g_state.store(new GateState(), std::memory_order_release);
  t_is_receiver = false;
}

bool CloseExitGate(double timeout_s) {
  GateState& state = State();
  PyThreadState* saved = PyEval_SaveThread();  // the threads past the gate need the GIL
  bool none_passing;
  {
    std::unique_lock<std::mutex> lock(state.mu);
    state.closed = true;
    none_passing = state.none_passing.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                               [&] { return state.passing == 0; });
  }
  PyEval_RestoreThread(saved);
  return none_passing;
}

}  // namespace hostcallback
