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

class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() {
    while (WouldBeEndedByFinalization()) std::this_thread::sleep_for(std::chrono::hours(1));
    PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_GIL_H_
