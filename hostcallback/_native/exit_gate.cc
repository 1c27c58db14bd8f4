#include "exit_gate.h"

#include <Python.h>

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

GateState& State() {
  static GateState* state = new GateState();  // never destroyed: threads may use it at exit
  return *state;
}

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
