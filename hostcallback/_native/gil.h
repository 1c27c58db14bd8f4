// GilReleased: releases the GIL for a section that touches no Python object, and takes it back
// after, unless the interpreter has begun to finalize. CPython ends a thread other than the one
// finalizing (the main thread) that takes the GIL back then with pthread_exit, and that forced
// unwind through a noexcept frame (a destructor, nanobind's dispatcher) aborts the process. Such a
// thread parks instead: the process is ending, and a parked thread holds no lock of ours. The
// check cannot cover a thread already waiting for the GIL when finalization begins: exit makes
// sure no computation of ours is still running then (the barrier waits for its markers' ends).
#ifndef HOSTCALLBACK_NATIVE_GIL_H_
#define HOSTCALLBACK_NATIVE_GIL_H_

#include <Python.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace hostcallback {

// The thread that runs Python's finalization; set when the module is imported (RememberMainThread).
inline unsigned long g_main_thread_ident = 0;

inline void RememberMainThread(unsigned long ident) { g_main_thread_ident = ident; }

inline bool IsFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Whether taking the GIL back now would end this thread.
inline bool WouldBeEndedByFinalization() {
  return IsFinalizing() && PyThread_get_thread_ident() != g_main_thread_ident;
}

// The exit gate as every extension of ours sees it: the core's (exit_gate.cc), shared with the
// add-ons' extensions through ShareExitGate. enter() says whether a thread coming back from a
// section without the GIL may take it (false: it parks); entered() follows once it has it.
struct ExitGate {
  bool (*enter)();
  void (*entered)();
};

inline std::atomic<const ExitGate*> g_exit_gate{nullptr};  // none: the finalization check only

// The name of the capsule that hands the core's gate to an add-on's extension.
inline constexpr char kExitGateCapsule[] = "hostcallback.exit_gate";

inline void ShareExitGate(const ExitGate* gate) {
  g_exit_gate.store(gate, std::memory_order_release);
}

[[noreturn]] inline void ParkForever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() {
    if (WouldBeEndedByFinalization()) ParkForever();
    const ExitGate* gate = g_exit_gate.load(std::memory_order_acquire);
    if (gate != nullptr && !gate->enter()) ParkForever();  // a thread counted takes the GIL
    PyEval_RestoreThread(state_);
    if (gate != nullptr) gate->entered();
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_GIL_H_
