// Python's pending signals, looked at from a wait of the main thread (interrupts.h).

#include "interrupts.h"

#include <Python.h>

#include <time.h>

#include <atomic>
#include <csignal>
#include <cstdint>

#include "gil.h"

namespace hostcallback {

namespace {
thread_local std::string t_last_interruption;

std::atomic<bool> g_interrupt_noted{false};
std::atomic<int64_t> g_last_interrupt_ns{0};  // CLOCK_MONOTONIC; 0: none yet
struct sigaction g_python_handler;  // what ours chains to; written before ours is installed

// Python's handler first: a wait that sees the note (on another thread: the signal may be
// delivered to any) must find Python's pending signal when it looks.
void OnInterrupt(int signum, siginfo_t* info, void* context) {
  if (g_python_handler.sa_flags & SA_SIGINFO) {
    g_python_handler.sa_sigaction(signum, info, context);
  } else if (g_python_handler.sa_handler != SIG_DFL && g_python_handler.sa_handler != SIG_IGN) {
    g_python_handler.sa_handler(signum);
  }
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  g_last_interrupt_ns.store(int64_t{now.tv_sec} * 1000000000 + now.tv_nsec);
  g_interrupt_noted.store(true);
}
}  // namespace

double SecondsSinceInterrupt() {
  const int64_t last = g_last_interrupt_ns.load();
  if (last == 0) return -1;
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(int64_t{now.tv_sec} * 1000000000 + now.tv_nsec - last) * 1e-9;
}

void WatchInterrupts() {
  static_assert(std::atomic<bool>::is_always_lock_free, "the signal handler stores it");
  struct sigaction now;
  if (sigaction(SIGINT, nullptr, &now) != 0) return;
  const bool ours = (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == OnInterrupt;
  if (ours || now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN) return;
  g_python_handler = now;
  struct sigaction chained = now;
  chained.sa_flags |= SA_SIGINFO;
  chained.sa_sigaction = OnInterrupt;
  sigaction(SIGINT, &chained, nullptr);
}

void NoteInterrupt() { g_interrupt_noted.store(true); }

bool TakeInterruptNote() {
  return g_interrupt_noted.load(std::memory_order_relaxed) && g_interrupt_noted.exchange(false);
}

const std::string& LastInterruption() { return t_last_interruption; }

bool OnMainThread() { return PyThread_get_thread_ident() == g_main_thread_ident; }

std::string CheckSignals() {
  if (!OnMainThread() || IsFinalizing()) return "";
  const PyGILState_STATE state = PyGILState_Ensure();
  std::string why;
  if (PyErr_CheckSignals() != 0) {
    PyObject* raised = PyErr_Occurred();
    const bool keyboard =
        raised != nullptr && PyErr_GivenExceptionMatches(raised, PyExc_KeyboardInterrupt);
    why = std::string("interrupted (") +
          (raised != nullptr ? reinterpret_cast<PyTypeObject*>(raised)->tp_name : "a signal") + ")";
    PyErr_Clear();
    if (keyboard) PyErr_SetInterruptEx(SIGINT);
  }
  PyGILState_Release(state);
  if (!why.empty()) t_last_interruption = why;
  return why;
}

}  // namespace hostcallback
