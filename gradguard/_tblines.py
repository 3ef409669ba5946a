"""TensorBoard line runs: a colour per series in gradguard's multi-line custom-scalars charts.

TensorBoard's CUSTOM SCALARS tab colours the lines of a chart by run (its colour scale is keyed by
the run name; the series of one run share a colour and differ only by marker shape), from a
palette of 7 colours handed out in the order of its runs list. As ``SummaryWriter.add_scalars``
does, the series of a multi-line chart (:data:`gradguard.dashboards.LINE_CHARTS`) are therefore
also written into runs of their own, folders inside the run's folder; but not one run per series
(a model's layers would add dozens of runs, and above 40 runs TensorBoard's runs selector enables
none by default: empty CUSTOM SCALARS, SCALARS and TEXT tabs). The n-th series of a chart (in the
order it first comes) goes to line run ``n mod 7``, under a tag of its own that the chart draws:

    <run>/gradguard-lines/<n mod 7>     tag gradguard-lines/<chart>/<key without gradguard/>

e.g. ``gradguard-lines/layer_grad_norm/grad_norm/fc1`` in ``<run>/gradguard-lines/0`` and
``.../grad_norm/head`` in ``<run>/gradguard-lines/1``. So a run adds at most 7 runs, and a chart's
first 7 series have 7 colours (an 8th repeats the first colour, as TensorBoard's palette does).
The run's own keys are written as before (same values, same steps); these runs repeat them.

Files: no writer thread and no file left open. Records are kept in memory and appended every
``flush_secs`` and at close, one open-append-close per line run (one event file each, made by this
writer). The line runs of one writer start at the same time (their first record's wall time):
TensorBoard orders runs by start time, then name, so they are neighbours in its runs list and take
7 different colours.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import socket
import time
from typing import Any

from . import _io, logdir
from .dashboards import LINE_COLOURS, LINES_DIR, LINES_TAG, line_charts

__all__ = ["LineRuns"]

_SEQ = itertools.count()
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _segment(name: str) -> str:
    name = _UNSAFE.sub("_", name)
    return "_" if name in ("", ".", "..") else name


class LineRuns:
    """The line runs of one TensorBoard run folder (``run_dir``). :meth:`add` takes a metric row
    (keys without an engine prefix); :meth:`flush` appends what is held. An I/O error turns the
    line runs off (nothing more is held or written) and is raised once, as an ``OSError`` naming
    the folder (the guard's sink handling warns and logs it; the run's own scalars go on)."""

    def __init__(self, run_dir: str, flush_secs: float = 10.0) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary, self._record_writer = Event, Summary, RecordWriter
        self.root = logdir.join(run_dir, LINES_DIR)
        self.flush_secs = flush_secs
        self.start = time.time()
        self.file_name = (f"events.out.tfevents.{int(self.start):010d}.{_segment(socket.gethostname())}."
                          f"{os.getpid()}.{next(_SEQ)}.gradguard")
        self.error: str | None = None
        #: per chart, each key's place in it (the order it first came): its line run is place mod 7
        self.places: dict[str, dict[str, int]] = {}
        self._targets: dict[str, list[tuple[str, str]]] = {}  # key -> [(event file, tag)]
        self._pending: dict[str, list[bytes]] = {}  # event file -> records not yet appended
        self._started: set[str] = set()  # event files that have their first record
        self._flushed_at = time.monotonic()

    def targets(self, key: str) -> list[tuple[str, str]]:
        """``(event file, tag)`` of each chart that draws ``key`` (none for a key of no multi-line chart)."""
        if key not in self._targets:
            label = key[len("gradguard/"):] if key.startswith("gradguard/") else ""
            out = []
            for chart in line_charts(key) if label else []:
                places = self.places.setdefault(chart, {})
                place = places.setdefault(key, len(places))
                path = logdir.join(self.root, str(place % LINE_COLOURS), self.file_name)
                out.append((path, f"{LINES_TAG}/{chart}/" + "/".join(map(_segment, label.split("/")))))
            self._targets[key] = out
        return self._targets[key]

    def _bytes(self, **event: Any) -> bytes:
        """One record of an event file (TensorBoard's framing: length, CRCs, the ``Event``)."""
        buf = io.BytesIO()
        self._record_writer(buf).write(self._event(**event).SerializeToString())
        return buf.getvalue()

    def add(self, step: int, metrics: dict[str, float]) -> None:
        """Hold ``metrics`` of ``step`` (the x value) for their line runs; appended when due."""
        if self.error is not None:
            return
        wall = time.time()
        for key, value in metrics.items():
            for path, tag in self.targets(key):
                summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
                self._pending.setdefault(path, []).append(self._bytes(wall_time=wall, step=int(step), summary=summary))
        if self._pending and time.monotonic() - self._flushed_at >= self.flush_secs:
            self.flush()

    def flush(self) -> None:
        """Append every held record to its line run's event file (the file begins with TensorBoard's
        version record, at the writer's start time)."""
        pending, self._pending = self._pending, {}
        self._flushed_at = time.monotonic()
        for path, records in pending.items():
            if path not in self._started:
                records.insert(0, self._bytes(wall_time=self.start, file_version="brain.Event:2"))
            try:
                if not logdir.is_url(path):
                    _io.check_write(path)
                with logdir.open_append(path, binary=True) as fh:
                    fh.write(b"".join(records))
            except Exception as exc:  # noqa: BLE001 - a remote file system raises its own errors
                self._pending = {}
                self.error = f"could not write {path} ({exc})"
                raise OSError(f"the TensorBoard line runs under {self.root} are off: {self.error}; the run's "
                              "own scalars go on") from exc
            self._started.add(path)

    def close(self) -> None:
        if self.error is None:
            self.flush()
