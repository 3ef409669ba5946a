import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_rescues_the_explosive_run(tmp_path):
    """The one real end-to-end run of the explosive setting: unguarded goes wrong, guarded ends
    near the hand-tuned run (this is the README's demo, ~1.5 min on 2 cores)."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "gradguard", "demo", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "| unguarded |" in proc.stdout and "| guarded |" in proc.stdout and "| tuned |" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    unguarded, guarded, tuned = (summary[k]["eval_loss"] for k in ("unguarded", "guarded", "tuned"))
    assert unguarded > 1.25 * tuned  # really goes wrong
    assert summary["unguarded"]["peak_loss"] > 1.5 * summary["curves"]["unguarded"][0]  # a real spike
    assert guarded < 1.08 * tuned  # really rescued
    assert summary["guarded"]["nonfinite_steps"] == 0
    assert summary["guarded"]["guard"]["actions"]["rollback"] >= 1
    events = [json.loads(line) for line in (out / "gradguard" / "events.jsonl").read_text().splitlines()]
    assert events[0]["type"] == "start" and events[-1]["type"] == "summary"
    assert any(e["type"] == "action" and e["name"] == "lower_lr" for e in events)
    report = out / "gradguard" / "report.html"  # the demo writes the report (plotly is in [dev])
    assert summary["guarded"]["report"] == str(report) and report.stat().st_size > 100_000
    assert summary["guarded"]["guard"]["advice"]["settings"]["lr_factor"] < 1


def test_demo_rejects_bad_steps():
    proc = subprocess.run([sys.executable, "-m", "gradguard", "demo", "--steps", "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--steps=2" in proc.stderr
