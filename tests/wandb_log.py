"""Read an offline W&B run back from its ``.wandb`` file (tests only).

The file is wandb's LevelDB-style log: 32 KiB blocks of CRC-checked chunks (7-byte header: crc,
length, type 1 full, 2 first, 3 middle, 4 last) around ``wandb_internal_pb2.Record`` protobufs.
wandb 0.31's Python package no longer ships a reader (its ``DataStore`` moved into the Go core)."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any


def records(path: str):
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # zero-padded block tail
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        if len(chunk) < n:
            return  # a record still being written: the caller reads the file again
        pos += 7 + n
        if kind == 0:
            pos += left - 7 - n
            continue
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def _key(item: Any, sep: str = "/") -> str:
    return item.key or sep.join(item.nested_key)


@dataclass
class Run:
    path: str
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # define_metric records
    finished: bool = False

    def rows_with(self, key: str) -> list[dict[str, Any]]:
        return [r for r in self.history if key in r]


def _read_once(path: str, sep: str = "/") -> Run:
    from google.protobuf.message import DecodeError

    run = Run(path)
    try:
        recs = list(records(path))
    except DecodeError:  # a record still being written: read again
        return run
    for rec in recs:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_key(i, sep): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            run.summary.update({_key(u, sep): json.loads(u.value_json) for u in rec.summary.update})
        elif kind == "alert":
            run.alerts.append({"title": rec.alert.title, "text": rec.alert.text, "level": rec.alert.level})
        elif kind == "metric":
            m = rec.metric
            run.metrics.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric,
                                "summary": [k for k in ("min", "max", "mean", "last", "best", "copy", "none")
                                            if getattr(m.summary, k, False)]})
        elif kind == "exit":
            run.finished = True
    return run


def read_runs(wandb_dir: str, sep: str = "/") -> list[Run]:
    """Every offline run under ``<wandb_dir>/wandb``, read after ``finish`` (the service writes
    asynchronously: a file without its exit record is read again, for up to a minute on a busy
    machine). ``sep`` joins nested keys (a table's ``path``, ``nrows``...)."""
    pattern = os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")
    paths = sorted(glob.glob(pattern))
    for _ in range(40):  # under load the service may create the file after finish() returned
        if paths:
            break
        time.sleep(0.5)
        paths = sorted(glob.glob(pattern))
    out = []
    for path in paths:
        for _ in range(120):
            run = _read_once(path, sep)
            if run.finished:
                break
            time.sleep(0.5)
        out.append(run)
    return out
