"""hostcallback's exceptions, and describing a user's exception or function on the error path,
where nothing may fail.

What the describing functions return is always text that encodes as UTF-8: a lone surrogate (a
file name from ``os.listdir`` that is not UTF-8) is written as its escape, since the core takes
UTF-8 only.
"""

from __future__ import annotations


class CallbackException(Exception):
    """A tap consumer raised since the last barrier_wait; ``__cause__`` is the first exception."""


class WaitTimedOut(TimeoutError):
    """A wait for the taps (a barrier, a stop, exit) ran out of time; ``reason`` says what it
    still waited for."""

    def __init__(self, what: str, timeout: float | None, reason: str) -> None:
        super().__init__(f"{what} timed out after {timeout} s: {reason}")
        self.what, self.timeout, self.reason = what, timeout, reason

    def __reduce__(self):  # pickled and copied with its own arguments, not the message
        return type(self), (self.what, self.timeout, self.reason)


class ReceiverStoppedError(RuntimeError):
    """The receivers were stopped (stop_outfeed_receiver(), or a fork): taps cannot be delivered
    any more."""


class CallResultError(TypeError):
    """A call consumer returned a pytree, shape or dtype other than its result_shape."""


class WireFormatError(ValueError):
    """Bytes that are not a well-formed tap record."""


class UnsupportedDtypeError(TypeError):
    """A dtype that has no byte layout on the wire (for example the packed 4-bit types)."""


class UndecodableRecordError(ValueError):
    """A record the receiver could not turn into arrays (numpy's dimension limit, memory); only
    its own consumer fails, and the next barrier reports it."""


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) written as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe_error(error: BaseException) -> str:
    """``Type: message``, and never an exception: a user's exception whose ``__str__`` fails (it
    formats an attribute it never set) is described by its type and why it could not say more."""
    name = getattr(type(error), "__name__", "exception")
    try:
        return printable(f"{name}: {error}")
    except BaseException as why:  # noqa: BLE001 - this is the error path; it must not fail
        try:
            return f"{name} (its message could not be formatted: {type(why).__name__})"
        except BaseException:  # noqa: BLE001
            return "exception"


def name_of(func: object) -> str:
    """A function's ``__name__``, else its ``repr``; never an exception: an object whose repr
    fails is named by its type."""
    try:
        name = getattr(func, "__name__", None)
        return printable(name if isinstance(name, str) else repr(func))
    except BaseException:  # noqa: BLE001 - a name on the error path must not fail
        return f"<{type(func).__qualname__} object>"
