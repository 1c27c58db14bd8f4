"""Describing a user's exception on the error path, where nothing may fail."""

from __future__ import annotations


def describe_error(error: BaseException) -> str:
    """``Type: message``, and never an exception: a user's exception whose ``__str__`` fails (it
    formats an attribute it never set) is described by its type and why it could not say more."""
    name = getattr(type(error), "__name__", "exception")
    try:
        return f"{name}: {error}"
    except BaseException as why:  # noqa: BLE001 - this is the error path; it must not fail
        try:
            return f"{name} (its message could not be formatted: {type(why).__name__})"
        except BaseException:  # noqa: BLE001
            return name
