"""The printer behind id_print and debug.print, and how it shows what was tapped.

id_print shows a value as a line of sorted ``key: value`` metadata, then the value. Tuples print as
``( a b )``, lists as ``[ a b ]``, dicts as ``{ k=v }`` and arrays through ``np.array2string``
with the given threshold, like the legacy host_callback.id_print. Transforms print as legacy did:
a bare name when it has no parameters (``'transpose'``), else the pair (``('batch', {'batch_dims':
(0,)})``). A format string (``jax.debug.print``'s habit) prints one formatted line instead.
debug.print writes what ``jax.debug.print`` writes: a tapped array shows as a ``HostArray``, which
prints, formats and reprs as a jax.Array does.
"""

from __future__ import annotations

import string
import sys
from typing import Any, TextIO

import numpy as np

from hostcallback._records.registry import EqualByKey

DEFAULT_THRESHOLD = 1024


def format_value(value: Any, threshold: int = DEFAULT_THRESHOLD,
                 summarize_above: int | None = None) -> str:
    """The value as id_print shows it; arrays of more than ``summarize_above`` elements (when
    given) as one line of statistics instead (``array_summary``)."""
    def fmt(v: Any) -> str:
        return format_value(v, threshold, summarize_above)

    if isinstance(value, tuple):
        return "( " + " ".join(fmt(v) for v in value) + " )"
    if isinstance(value, list):
        return "[ " + " ".join(fmt(v) for v in value) + " ]"
    if isinstance(value, dict):
        return "{ " + " ".join(f"{k}={fmt(v)}" for k, v in sorted(value.items())) + " }"
    if isinstance(value, np.ndarray):
        if summarize_above is not None and value.size > summarize_above:
            return array_summary(value)
        return np.array2string(value, threshold=threshold)
    return str(value)


def array_summary(array: np.ndarray) -> str:
    """``float32[10, 32] mean=0.5 min=0 max=1``: dtype and shape, and the statistics of a real
    numeric array."""
    described = f"{array.dtype}{list(array.shape)}"
    if not array.size or np.iscomplexobj(array):
        return described
    try:  # numbers, bool, and ml_dtypes' floats (bfloat16, float8_*), which numpy does not
        as_float = array.astype(np.float64)  # class as numbers
    except (TypeError, ValueError):
        return described
    return (f"{described} mean={as_float.mean():.6g} min={as_float.min():.6g} "
            f"max={as_float.max():.6g}")


def legacy_transform(transform: tuple) -> Any:
    """``('transpose', {})`` and ``('jvp',)`` print as their name, others as (name, params)."""
    name, *rest = transform
    params = rest[0] if rest else {}
    return (name, params) if params else name


def format_metadata(metadata: dict[str, Any], transforms: tuple, device: Any = None) -> str:
    fields = dict(metadata)
    if transforms:
        fields["transforms"] = [legacy_transform(t) for t in transforms]
    if device is not None:
        fields["device"] = device
    return " ".join(f"{key}: {value}" for key, value in sorted(fields.items()))


def print_tap(arg: Any, transforms: tuple, *, device: Any = None,
              output_stream: TextIO | None = None, threshold: int | None = None,
              **metadata: Any) -> None:
    """The consumer behind id_print; writes one block of text per tap."""
    stream = output_stream if output_stream is not None else sys.stdout
    header = format_metadata(metadata, transforms, device)
    body = format_value(arg, DEFAULT_THRESHOLD if threshold is None else threshold)
    stream.write((header + "\n" if header else "") + body + "\n")
    if hasattr(stream, "flush"):
        stream.flush()


def print_formatted(fmt: str, args: tuple, kwargs: dict, transforms: tuple, *, device: Any = None,
                    output_stream: TextIO | None = None) -> None:
    """The consumer behind ``id_print("step {step}", step=step)``: one ``str.format`` line, with
    the transforms and device (when there are some) as a metadata line first, as for values."""
    stream = output_stream if output_stream is not None else sys.stdout
    header = format_metadata({}, transforms, device)
    line = fmt.format(*args, **kwargs)
    stream.write((header + "\n" if header else "") + line + "\n")
    if hasattr(stream, "flush"):
        stream.flush()


def has_fields(fmt: str) -> bool:
    """Whether ``jax.debug.print`` formats ``fmt`` (else it prints it and the values)."""
    fields = [field for _, field, _, _ in string.Formatter().parse(fmt)] if fmt else []
    return bool(fields) and fields[0] is not None


def jax_print_line(fmt: str, formats: bool, args: tuple, kwargs: dict,
                   print_options: tuple) -> str:
    """What ``jax.debug.print(fmt, *args, **kwargs)`` prints: with ``formats`` (``has_fields``),
    ``fmt.format`` under the numpy print options in force where it was traced; else the string
    and the values separated by spaces."""
    if formats:
        with np.printoptions(**dict(print_options)):
            return fmt.format(*args, **kwargs)
    return " ".join((fmt, *(str(a) for a in args)))


class Printer(EqualByKey):
    """Every printing consumer. As id_print's (called ``(arg, transforms, device)``): the value
    with its metadata, or with ``fmt`` one formatted line of the tapped ``(args, kwargs)``. As
    debug.print's (``apply(args, kwargs)``, once per batch element, with ``jax_formats``, which
    ``has_fields`` decided at trace time): ``jax_print_line`` under ``print_options``. Equal for
    equal settings, so that a retrace reuses the consumer id."""

    __slots__ = ("fmt", "jax_formats", "metadata", "output_stream", "print_options", "threshold")

    def __init__(self, fmt: str | None = None, *, output_stream: TextIO | None = None,
                 threshold: int | None = None, metadata: dict[str, Any] | None = None,
                 print_options: tuple = (), jax_formats: bool = False) -> None:
        self.fmt, self.output_stream, self.threshold = fmt, output_stream, threshold
        self.metadata, self.print_options = dict(metadata or {}), print_options
        self.jax_formats = jax_formats

    def _key(self):
        return (self.fmt, id(self.output_stream), self.threshold,
                repr(sorted(self.metadata.items())), repr(self.print_options), self.jax_formats)

    def __call__(self, arg: Any, transforms: tuple, device: Any = None) -> None:
        if self.fmt is None:
            print_tap(arg, transforms, device=device, output_stream=self.output_stream,
                      threshold=self.threshold, **self.metadata)
        else:
            args, kwargs = arg
            print_formatted(self.fmt, args, kwargs, transforms, device=device,
                            output_stream=self.output_stream)

    def apply(self, args: tuple, kwargs: dict) -> None:
        stream = self.output_stream if self.output_stream is not None else sys.stdout
        stream.write(jax_print_line(self.fmt, self.jax_formats, args, kwargs,
                                    self.print_options) + "\n")


class HostArray(np.ndarray):
    """A tapped array as ``hostcallback.debug.print`` and a served ``jax.debug.print`` format
    it: a read-only numpy array (a view of the record, no copy) that prints, formats and reprs
    as a CPU ``jax.Array`` does, so they write what ``jax.debug.print`` writes."""

    def __repr__(self) -> str:
        prefix, dtype = "Array(", f"dtype={self.dtype.name}"
        value = self.view(np.ndarray)
        if value.size == 0:
            shown = f"[], shape={value.shape}"
        else:
            shown = np.array2string(value, prefix=prefix, suffix=",", separator=", ",
                                    max_line_width=np.get_printoptions()["linewidth"])
        last_line = len(shown) - shown.rfind("\n") + 1
        separator = " " * len(prefix) if last_line + len(dtype) + 2 > \
            np.get_printoptions()["linewidth"] else " "
        return f"{prefix}{shown},{separator}{dtype})"

    def __str__(self) -> str:
        return str(self.view(np.ndarray))

    def __format__(self, format_spec: str) -> str:
        value = self.view(np.ndarray)
        return format(value if value.ndim else value[()], format_spec)
