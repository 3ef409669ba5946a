import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_rescues_the_explosive_run(tmp_path):
    """The one real end-to-end run of the explosive setting: unguarded goes wrong, guarded ends
    near the hand-tuned run (this is the README's demo; no wall-clock limit: a slow machine only
    takes longer). Not quiet: a progress display per arm on stderr, the table, and the HTML report's
    path, or the one line saying how to get it (the former short-demo test, merged: one run less)."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "gradguard", "demo", "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "| unguarded |" in proc.stdout and "| guarded |" in proc.stdout and "| tuned |" in proc.stdout
    for arm in ("unguarded", "guarded", "tuned"):
        assert arm in proc.stderr  # a progress display per arm (tqdm's bar or the plain progress line)
    try:
        import plotly  # noqa: F401
    except ImportError:
        assert "pip install 'gradguard[report]'" in proc.stdout
    else:
        assert f"report: {out / 'gradguard' / 'report.html'}" in proc.stdout
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
    assert summary["guarded"]["report"] == str(report) and report.stat().st_size > 20_000
    assert (out / "gradguard" / "plotly.min.js").stat().st_size > 1_000_000  # plotly.js once, beside it
    assert summary["guarded"]["guard"]["advice"]["settings"]["lr_factor"] < 1
    # the written diagnosis of the guarded run, each sentence true of its event log
    from .test_diagnosis import check_log_file

    lines = check_log_file(out / "gradguard" / "events.jsonl")
    assert "The guard rolled back" in " ".join(lines)


def test_demo_rejects_bad_steps():
    proc = subprocess.run([sys.executable, "-m", "gradguard", "demo", "--steps", "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--steps=2" in proc.stderr


def test_version():
    import gradguard

    proc = subprocess.run([sys.executable, "-m", "gradguard", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"gradguard {gradguard.__version__}"
    from importlib import metadata

    assert gradguard.__version__ == metadata.version("gradguard")


def test_quiet_demo_prints_only_the_table(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gradguard", "demo", "--out", str(tmp_path / "demo"), "--steps", "10",
                           "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| run |") and len(lines) == 5 and "| guarded |" in proc.stdout
    assert "guarded:" not in proc.stderr and "step/s" not in proc.stderr  # no progress display


def test_plain_progress_without_tqdm():
    import io

    from gradguard.demo import Progress

    stream = io.StringIO()
    p = Progress("guarded", 20, stream=stream, every=10)
    for i in range(1, 21):
        p(i, 2.5)
    p.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("  guarded: step 10/20, loss 2.5")
