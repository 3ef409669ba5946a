"""Compare an engine test suite run without and with gradguard attached.

``python compare.py RESULTS_DIR`` reads ``junit-<file>-<mode>.xml`` (and, when present, the
``<file>-<mode>.jsonl`` records of ``hf_attach.py``) for mode in none/monitor/default and prints:
one row per test file (baseline passed/failed/skipped, then the tests that passed in the baseline
and did not pass with the callback, per mode), then each such test, each ``train()`` whose
final weights, logged values, global step or arguments differ from the baseline, and each
``train()`` in which the guard found something or acted. Tests that fail in the baseline are left
out of the comparison."""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET
from typing import Any

MODES = ("none", "monitor", "default")
_PATHS = ("output_dir", "logging_dir", "run_name")  # temporary folders differ from run to run


def outcomes(path: str) -> dict[str, str]:
    res: dict[str, str] = {}
    if not os.path.exists(path):
        return res
    for tc in ET.parse(path).getroot().iter("testcase"):
        kind = "passed"
        for child in tc:
            if child.tag in ("failure", "error"):
                kind = "failed"
            elif child.tag == "skipped":
                kind = "skipped"
        res[f"{tc.get('classname')}::{tc.get('name')}"] = kind
    return res


def records(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                out[(r["test"], r["n"])] = r
    return out


def record_diffs(base: dict, other: dict, skip: frozenset = frozenset()) -> list[str]:
    """What differs between two runs' records, per ``train()``; ``skip``: keys left out."""
    diffs = []
    for key, b in sorted(base.items()):
        o = other.get(key)
        where = f"{key[0]} train() #{key[1]}"
        if key in skip:
            continue
        if o is None:
            diffs.append(f"{where}: no record with the callback")
            continue
        if b["params"] != o["params"]:
            diffs.append(f"{where}: final parameters differ")
        if b["global_step"] != o["global_step"]:
            diffs.append(f"{where}: global_step {b['global_step']} != {o['global_step']}")
        if len(b["log_history"]) != len(o["log_history"]):
            diffs.append(f"{where}: log_history has {len(b['log_history'])} != {len(o['log_history'])} entries")
        for i, (eb, eo) in enumerate(zip(b["log_history"], o["log_history"])):
            if eb != eo:
                keys = sorted(k for k in set(eb) | set(eo) if eb.get(k) != eo.get(k))
                diffs.append(f"{where}: log_history[{i}] {[(k, eb.get(k), eo.get(k)) for k in keys][:4]}")
                break
        args = sorted(k for k in set(b["args"]) | set(o["args"])
                      if b["args"].get(k) != o["args"].get(k) and k not in _PATHS)
        if args:
            diffs.append(f"{where}: TrainingArguments differ after train(): "
                         f"{[(k, b['args'].get(k), o['args'].get(k)) for k in args]}")
    return diffs


def main(results: str) -> int:
    names = sorted({os.path.basename(p)[len("junit-"):].rsplit("-", 1)[0]
                    for p in glob.glob(os.path.join(results, "junit-*.xml"))})
    print(f"| {'file':34s} | baseline passed/failed/skipped | monitor: new failures | default: new failures |")
    print(f"|{'-' * 36}|{'-' * 32}|{'-' * 23}|{'-' * 23}|")
    lines: list[str] = []
    for name in names:
        res = {m: outcomes(os.path.join(results, f"junit-{name}-{m}.xml")) for m in MODES}
        base = res["none"]
        count = collections.Counter(base.values())
        cells = [f"{count['passed']}/{count['failed']}/{count['skipped']}"]
        base_rec = records(os.path.join(results, f"{name}-none.jsonl"))
        # a second baseline run (mode "none2"), when there is one: train() calls that differ between two
        # runs without gradguard (unseeded tests) say nothing about gradguard and are left out
        again = records(os.path.join(results, f"{name}-none2.jsonl"))
        noisy = frozenset(k for k in base_rec if again and record_diffs({k: base_rec[k]}, again))
        lines += [f"NONDETERMINISTIC without gradguard (left out): {k[0]} train() #{k[1]}" for k in sorted(noisy)]
        for m in MODES[1:]:
            if not res[m]:
                cells.append("-")
                continue
            new = sorted(t for t, k in base.items() if k == "passed" and res[m].get(t) != "passed")
            cells.append(str(len(new)))
            lines += [f"{m}: FAILS {t}" for t in new]
            rec = records(os.path.join(results, f"{name}-{m}.jsonl"))
            lines += [f"{m}: DIFFERS {d}" for d in record_diffs(base_rec, rec, noisy)]
            lines += [f"{m}: GUARD {k[0]} train() #{k[1]}: {r['guard']}" for k, r in sorted(rec.items())
                      if (r.get("guard") or {}).get("findings") or (r.get("guard") or {}).get("actions")]
        print(f"| {name:34s} | {cells[0]:>30s} | {cells[1]:>21s} | {cells[2]:>21s} |")
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results"))
