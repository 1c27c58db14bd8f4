// The exit gate: exit's handler closes it once it has delivered what it could (lifecycle.py).
// From then on a receiver thread (one that called MarkReceiverThread) that comes back from a
// section without the GIL parks instead of taking the GIL, and closing waits until the receiver
// threads already past the gate have the GIL: so none is still on its way to the GIL when
// finalization begins, where CPython would end it from inside a noexcept frame (an abort; see
// gil.h). Other threads (JAX's, the user's) go on as before: parking one of them could hold up a
// computation that JAX's own exit handlers wait for.
#ifndef HOSTCALLBACK_NATIVE_EXIT_GATE_H_
#define HOSTCALLBACK_NATIVE_EXIT_GATE_H_

#include "gil.h"

namespace hostcallback {

// The core's gate, for GilReleased here and in the add-ons' extensions (ShareExitGate).
const ExitGate* CoreExitGate();

// Marks the calling thread as a receiver: it parks at a closed gate.
void MarkReceiverThread();

// In a fork() child: a gate of its own, open, and the forking thread no receiver (the child has
// no receivers; the parent's lock may have been held by a thread the child does not have).
void ResetExitGateInChild();

// Closes the gate and waits, without the GIL, at most timeout_s for the receiver threads past it
// to have the GIL back; false if one still had not (called by the main thread, with the GIL).
bool CloseExitGate(double timeout_s);

}  // namespace hostcallback

#endif  // HOSTCALLBACK_NATIVE_EXIT_GATE_H_
