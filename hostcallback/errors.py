"""Describing a user's exception or function on the error path, where nothing may fail.

What these return is always text that encodes as UTF-8: a lone surrogate (a file name from
``os.listdir`` that is not UTF-8) is written as its escape, since the core takes UTF-8 only.
"""

from __future__ import annotations


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
