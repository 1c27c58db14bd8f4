"""Progress bars fed by taps: ``ProgressSink``, and progress for ``lax.scan``/``fori_loop``.

``ProgressSink`` shows how far a run is: a tqdm bar on a terminal (step count, steps/s, the
latest scalar values in the postfix), plain periodic lines when its output is a file or a pipe
(a log stays readable; no carriage returns). It is a sink like any other, so a Python training
loop feeds it with ``tap_to([ProgressSink(total=1000)], {"step": step, "loss": loss}, name=...)``.

For loops that run inside one computation there are two ways in:

- ``scan_progress(n)`` and ``loop_progress(n)`` decorate a ``lax.scan`` or ``lax.fori_loop``
  body, in the spirit of jax-tqdm (same calling convention): every ``every`` steps a tap reports
  the step. The body then holds a conditional tap, which keeps XLA from fusing it into one
  kernel: about 50 ns per step on CPU, less than half of what jax-tqdm adds.
- ``progress_fori_loop`` and ``progress_scan`` replace the loop itself and run it in chunks of
  ``every`` steps with one tap between chunks, so the body stays untouched and the bar costs
  nothing per step (bench/progress_overhead.py measures both against jax-tqdm).

The bar closes when the last step arrives. ``progress_fori_loop`` and ``progress_scan`` close it
before the loop's results are ready: with a ProgressSink, their last report is followed by a
``call`` that waits until the bar is drawn, so its last line is out before the code after the
computation prints. That is one host round trip per loop, and, as for any computation with a
``call``, dispatch on CPU waits for the computation. Every other report is an ordinary tap,
handled on the receiver threads without blocking the device. tqdm is needed only for a terminal
(the ``progress`` extra); this module never imports it otherwise.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hostcallback
from hostcallback.addons import add_flush_hook

from .sink_base import Sink, tap_to
from .stream import TapRecord


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressSink(Sink):
    """A progress bar over the records it receives.

    The position is the record's ``step`` + 1 (taps report the step they just finished), or the
    number of records when they carry no step; the furthest device sets the position, and a
    device that reports a step lower than its own last starts a new bar (a loop that runs
    again). ``total`` gives percentages and an ETA, and the bar closes when
    the position reaches it. ``bar``: True for tqdm, False for plain lines every
    ``line_seconds``, None (default) for tqdm exactly when ``file`` (stderr) is a terminal.
    """

    def __init__(self, total: int | None = None, desc: str | None = None,
                 file: TextIO | None = None, *, bar: bool | None = None,
                 line_seconds: float = 10.0, postfix: bool = True, unit: str = "step",
                 **tqdm_kwargs: Any) -> None:
        if total is not None and total < 0:
            raise ValueError(f"ProgressSink(total={total}): total must be a step count >= 0, "
                             "or None when the number of steps is not known")
        self.total = total
        self.desc = desc
        self.file = file
        self.use_bar = bar
        self.line_seconds = line_seconds
        self.postfix = postfix
        self.unit = unit
        self.tqdm_kwargs = tqdm_kwargs
        self.position = 0
        self.values: dict[str, float] = {}
        self.bars_started = 0
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._finished_unwaited = 0  # bars finished that no wait() has returned for yet
        self._bar = None  # a tqdm bar, or _Lines
        self._bar_done = False  # the last bar reached total; late reports of it are ignored
        self._run = 0  # which run of the loop the bar shows
        self._sources: dict[tuple[int, int], tuple[int, int]] = {}  # device -> (run, position)
        if self.use_bar is None:
            self.use_bar = _is_terminal(self._out())
        if self.use_bar:
            _import_tqdm()  # fail here, at construction, rather than on a receiver thread
        add_flush_hook(self)

    def _out(self) -> TextIO:
        return self.file if self.file is not None else sys.stderr

    def _start(self, position: int) -> None:
        # The bar starts where the first record says, so its rate counts only the steps it saw
        # happen (the first record of a chunked loop comes after a whole chunk).
        self.bars_started += 1
        self.position = 0
        if self.use_bar:
            tqdm = _import_tqdm()
            kwargs = {"dynamic_ncols": True, "mininterval": 0.1, **self.tqdm_kwargs}
            self._bar = tqdm(total=self.total, desc=self.desc, file=self._out(), unit=self.unit,
                             initial=position, **kwargs)
            self.position = position
        else:
            self._bar = _Lines(self)

    def emit(self, record: TapRecord) -> None:
        reported = record.step + 1 if record.step is not None else None
        values = _scalars(record.value) if self.postfix else {}
        source = (record.process, record.device_id)
        with self._lock:
            # Devices report independently: one may still send the end of the last run while
            # another has begun the next. Each device counts its runs (a step lower than its own
            # last one begins one), and the bar follows the newest run.
            run, last = self._sources.get(source, (self._run, 0))
            # A lower step begins a run; so does the same step again once this source's bar is
            # done (a loop whose only report is its last step, run twice).
            if reported is not None and (reported < last or (
                    reported == last and run == self._run and self._bar is None
                    and self._bar_done)):
                run += 1
            self._sources[source] = (run, last if reported is None else reported)
            if run < self._run:
                return  # a slower device's report on an earlier run
            if run > self._run:
                self._finish()
                self._run, self._bar_done = run, False
            if self._bar is None:
                if self._bar_done and reported is not None:
                    return  # a slower device reporting on the bar that just finished
                self._bar_done = False
                self._start(0 if reported is None else reported)
            position = self.position + 1 if reported is None else reported
            self.values.update(values)
            advance = position - self.position
            self.position = max(position, self.position)
            if self.use_bar:
                if self.values:
                    self._bar.set_postfix(_postfix(self.values), refresh=False)
                self._bar.update(max(advance, 0))
            else:
                self._bar.update()
            if self.total is not None and self.position >= self.total:
                self._finish()
                self._bar_done = True

    def _finish(self) -> None:
        bar, self._bar = self._bar, None
        if bar is None:
            return
        self._finished_unwaited += 1
        self._finished.notify_all()
        if self.use_bar:
            bar.set_postfix(_postfix(self.values), refresh=False)
            bar.close()
        else:
            bar.line(final=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until a bar finishes (reaches ``total`` or is closed), and returns True; False
        after ``timeout`` seconds. Each finished bar ends one wait, so calling ``wait()`` after
        every loop waits for that loop's bar, without the cost of a ``barrier_wait``."""
        with self._finished:
            if not self._finished.wait_for(lambda: self._finished_unwaited > 0, timeout):
                return False
            self._finished_unwaited -= 1
            return True

    def flush(self) -> None:
        """At every barrier: show the latest position (a bar refreshes only now and then)."""
        with self._lock:
            if self._bar is not None and self.use_bar:
                self._bar.refresh()
        try:
            self._out().flush()
        except (ValueError, OSError):
            pass  # a closed stream at interpreter exit

    def close(self) -> None:
        """Ends the bar where it stands (a run that stopped early)."""
        with self._lock:
            self._finish()


def _scalars(value: Any, prefix: str = "") -> dict[str, float]:
    """The scalar leaves of a tapped value by their path (``loss``, ``norms.layer1``), for the
    postfix; arrays and the step are left out (a bar has room for a few numbers only)."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if not (prefix == "" and key == "step"):
                out.update(_scalars(item, f"{prefix}{key}."))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            out.update(_scalars(item, f"{prefix}{index}."))
    else:
        array = np.asarray(value)
        if array.size == 1 and (np.issubdtype(array.dtype, np.number) or array.dtype == bool) \
                and not np.iscomplexobj(array):
            out[prefix[:-1] or "value"] = float(array.reshape(()))
    return out


def _postfix(values: dict[str, float]) -> dict[str, str]:
    return {key: f"{value:.4g}" for key, value in values.items()}


def _import_tqdm():
    try:
        from tqdm import tqdm
    except ImportError as error:
        raise ImportError("a progress bar on a terminal needs tqdm: pip install "
                          "'hostcallback[progress]' (or pass bar=False for plain lines)") from error
    return tqdm


class _Lines:
    """Plain progress lines for logs: the first step, then at most one per ``line_seconds``,
    and a last one at the end."""

    def __init__(self, sink: ProgressSink) -> None:
        self.sink = sink
        self.started = time.monotonic()
        self.first_position = None  # the rate counts from the first record on
        self.last_line = -math.inf

    def update(self) -> None:
        if self.first_position is None:
            self.first_position = self.sink.position
        if time.monotonic() - self.last_line >= self.sink.line_seconds:
            self.line()

    def line(self, final: bool = False) -> None:
        sink = self.sink
        now = time.monotonic()
        self.last_line = now
        elapsed = now - self.started
        done = sink.position - (self.first_position or 0)
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        parts = [f"{sink.desc}:" if sink.desc else "progress:"]
        if sink.total:
            parts.append(f"{sink.position}/{sink.total} {sink.unit}s "
                         f"({100 * sink.position / sink.total:.0f}%)")
        else:
            parts.append(f"{sink.position} {sink.unit}s")
        if rate:
            parts.append(f"{rate:.4g} {sink.unit}s/s")
        parts.append(f"elapsed {elapsed:.1f} s")
        if sink.total and rate > 0 and not final:
            parts.append(f"eta {(sink.total - sink.position) / rate:.1f} s")
        parts += [f"{key}={value}" for key, value in _postfix(sink.values).items()]
        if final:
            parts.append("done" if sink.total is None or sink.position >= sink.total
                         else "stopped")
        print(", ".join([" ".join(parts[:2])] + parts[2:]), file=sink._out(), flush=True)


# ---- loops inside a computation ------------------------------------------------------------


def _default_every(n: int) -> int:
    return max(1, n // 100)


def _check_steps(who: str, n: Any, every: int | None) -> int:
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{who}: the number of steps must be a Python int >= 1, got {n!r} "
                         "(the bar needs to know the loop's length when it is traced)")
    every = _default_every(int(n)) if every is None else every
    if not isinstance(every, (int, np.integer)) or every < 1:
        raise ValueError(f"{who}: every={every!r} must be an int >= 1 (report every N steps)")
    return int(every)


def _progress_tap(sink: Sink, name: str, step, carry, metrics) -> None:
    payload = {"step": step}
    if metrics is not None:
        payload.update(metrics(carry))
    tap_to([sink], payload, name=name)


class _DrawnBy:
    """A call function that returns once a ProgressSink has drawn what was tapped before it:
    records of one device reach their consumers in program order, so by the time it runs the
    loop's last report has been emitted; flushing puts its line out."""

    def __init__(self, sink: ProgressSink) -> None:
        self.sink = sink
        self.__name__ = "progress bar drawn"

    def __call__(self, step) -> None:
        self.sink.flush()


def _wait_until_drawn(sink: Sink, last_step) -> None:
    """For a ProgressSink, a call after the loop's last report that the computation waits for
    until the bar is drawn. Taps and calls keep program order; ``last_step``, counted inside the
    loop, keeps XLA from running the call before the loop has run. Other sinks get no call: they
    draw no bar, and flushing one (a SocketSink) could keep the device waiting on the network."""
    if isinstance(sink, ProgressSink):
        hostcallback.call(_DrawnBy(sink), last_step)


def _loop_sink(n: int, desc: str | None, sink: Sink | None, file: TextIO | None) -> Sink:
    return sink if sink is not None else ProgressSink(total=n, desc=desc, file=file)


def loop_progress(n: int, *, every: int | None = None, desc: str | None = None,
                  sink: Sink | None = None, file: TextIO | None = None,
                  metrics: Callable[[Any], dict[str, Any]] | None = None,
                  ) -> Callable[[Callable], Callable]:
    """Decorates a ``lax.fori_loop`` body ``body(i, carry)`` to report progress every ``every``
    steps (default n/100) and at the last step, for a loop of ``n`` steps from 0.

    ``metrics(carry)`` may pick scalars from the new carry for the bar's postfix. The bar is a
    ``ProgressSink(total=n, desc=desc, file=file)`` unless ``sink`` is given.
    """
    every = _check_steps("loop_progress", n, every)
    sink = _loop_sink(n, desc, sink, file)
    name = desc or "progress"

    def decorate(body: Callable) -> Callable:
        def body_with_progress(i, carry):
            carry = body(i, carry)
            report = ((i + 1) % every == 0) | (i + 1 == n)
            lax.cond(report, lambda: _progress_tap(sink, name, i, carry, metrics), lambda: None)
            return carry

        body_with_progress.progress_sink = sink
        return body_with_progress

    return decorate


def scan_progress(n: int, *, every: int | None = None, desc: str | None = None,
                  sink: Sink | None = None, file: TextIO | None = None,
                  metrics: Callable[[Any], dict[str, Any]] | None = None,
                  ) -> Callable[[Callable], Callable]:
    """Decorates a ``lax.scan`` body ``f(carry, x)`` to report progress, as ``loop_progress``.

    As with jax-tqdm, the scan must run over ``jnp.arange(n)`` or over a tuple whose first
    element is ``jnp.arange(n)``: that is how the body knows its step.
    """
    every = _check_steps("scan_progress", n, every)
    sink = _loop_sink(n, desc, sink, file)
    name = desc or "progress"

    def decorate(f: Callable) -> Callable:
        def f_with_progress(carry, x):
            i = x[0] if isinstance(x, tuple) else x
            carry, y = f(carry, x)
            report = ((i + 1) % every == 0) | (i + 1 == n)
            lax.cond(report, lambda: _progress_tap(sink, name, i, carry, metrics), lambda: None)
            return carry, y

        f_with_progress.progress_sink = sink
        return f_with_progress

    return decorate


def progress_fori_loop(lower: int, upper: int, body: Callable, init: Any, *,
                       every: int | None = None, desc: str | None = None,
                       sink: Sink | None = None, file: TextIO | None = None,
                       metrics: Callable[[Any], dict[str, Any]] | None = None) -> Any:
    """``lax.fori_loop(lower, upper, body, init)`` with a progress bar that costs no time per
    step: the loop runs in chunks of ``every`` steps (default n/100), one tap after each.

    ``lower`` and ``upper`` must be Python ints. Same result as ``lax.fori_loop``.
    """
    if not all(isinstance(b, (int, np.integer)) for b in (lower, upper)):
        raise ValueError("progress_fori_loop: lower and upper must be Python ints (the loop is "
                         "split into chunks when traced); use loop_progress for traced bounds")
    n = int(upper) - int(lower)
    every = _check_steps("progress_fori_loop", n, every)
    sink = _loop_sink(n, desc, sink, file)
    name = desc or "progress"
    chunks, rest = divmod(n, every)

    # Each tap reports a step counted inside the loop it follows: a step computed from
    # constants would let XLA tap before the loop has run (CPU thunks run as soon as their
    # inputs are ready), and the last chunk would reach the bar first.
    def counted(i, carry_and_step):
        carry, _ = carry_and_step
        return body(i, carry), i - lower

    def chunk(c, carry_and_step):
        start = lower + c * every
        carry, step = lax.fori_loop(start, start + every, counted, (carry_and_step[0], 0))
        _progress_tap(sink, name, step, carry, metrics)
        return carry, jnp.int32(step)  # int32 whatever the index type (jax_enable_x64)

    carry, last_step = init, jnp.int32(-1)
    if chunks:
        carry, last_step = lax.fori_loop(0, chunks, chunk, (carry, last_step))
    if rest:
        carry, last_step = lax.fori_loop(upper - rest, upper, counted, (carry, 0))
        _progress_tap(sink, name, last_step, carry, metrics)
    if n > 0:
        _wait_until_drawn(sink, last_step)
    return carry


def progress_scan(f: Callable, init: Any, xs: Any = None, length: int | None = None, *,
                  every: int | None = None, desc: str | None = None, sink: Sink | None = None,
                  file: TextIO | None = None,
                  metrics: Callable[[Any], dict[str, Any]] | None = None) -> tuple[Any, Any]:
    """``lax.scan(f, init, xs, length)`` with a progress bar that costs no time per step: the
    scan runs in chunks of ``every`` steps, one tap after each. Same results as ``lax.scan``.
    """
    leaves = jax.tree_util.tree_leaves(xs)
    n = length if length is not None else (leaves[0].shape[0] if leaves else None)
    if n is None:
        raise ValueError("progress_scan: give xs or length (the number of steps)")
    every = _check_steps("progress_scan", n, every)
    sink = _loop_sink(n, desc, sink, file)
    name = desc or "progress"
    chunks, rest = divmod(n, every)
    split = chunks * every

    def head(x):
        return x[:split].reshape((chunks, every) + x.shape[1:])

    def counted(carry_and_step, x):  # the step is counted in the loop: see progress_fori_loop
        carry, step = carry_and_step
        carry, y = f(carry, x)
        return (carry, step + 1), y

    def chunk(carry_and_step, xs_chunk):
        (carry, step), ys = lax.scan(counted, carry_and_step, xs_chunk, length=every)
        _progress_tap(sink, name, step - 1, carry, metrics)
        return (carry, step), ys

    carry_and_step, pieces = (init, jnp.int32(0)), []
    if chunks:
        xs_head = jax.tree_util.tree_map(head, xs) if xs is not None else None
        carry_and_step, ys = lax.scan(chunk, carry_and_step, xs_head, length=chunks)
        pieces.append(jax.tree_util.tree_map(lambda y: y.reshape((split,) + y.shape[2:]), ys))
    if rest:
        xs_tail = jax.tree_util.tree_map(lambda x: x[split:], xs) if xs is not None else None
        carry_and_step, ys = lax.scan(counted, carry_and_step, xs_tail, length=rest)
        _progress_tap(sink, name, carry_and_step[1] - 1, carry_and_step[0], metrics)
        pieces.append(ys)
    carry = carry_and_step[0]
    if n > 0:
        _wait_until_drawn(sink, carry_and_step[1])
    if len(pieces) == 1:
        return carry, pieces[0]
    return carry, jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), *pieces)
