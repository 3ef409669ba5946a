"""``gradguard report``: the HTML report of a real run, opened in real headless Chromium with the
network blocked; the written diagnosis; the advice for the next run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from gradguard.advice import advise, advise_from_records
from gradguard.cli import main as cli_main
from gradguard.errors import ConfigError
from gradguard.report import diagnose, read_log, write_report

from .test_dashboards import _real_run

pytest.importorskip("plotly")
pytestmark = pytest.mark.usefixtures("one_thread")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# headless, no sandbox (root in CI), nothing that phones home, and every connection refused:
# a proxy on the discard port and a resolver that resolves nothing
OFFLINE_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
                 "--virtual-time-budget=15000"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    summary = _real_run(out, [])
    assert {"rollback", "lower_lr"} <= set(summary["actions"])
    return out


def _chromium(tmp_path, *args):
    return subprocess.run([CHROMIUM, *OFFLINE_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


def test_the_report_is_self_contained_and_renders_in_headless_chromium(run_dir, tmp_path):
    out = tmp_path / "report.html"
    assert cli_main(["report", str(run_dir), "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    # nothing to fetch: no external script, stylesheet or image
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=["']?(https?:)?//""", text)
    assert "Plotly.newPlot" in text and 'id="gg-heatmap"' in text
    # plotly.js once per folder, next to the report (not 4.8 MB inside every report)
    js = tmp_path / "plotly.min.js"
    assert js.stat().st_size > 1_000_000 and out.stat().st_size < 1_000_000
    assert '<script charset="utf-8" src="plotly.min.js"></script>' in text
    before = js.stat().st_mtime_ns
    assert cli_main(["report", str(run_dir), "-o", str(tmp_path / "second.html")]) == 0
    assert js.stat().st_mtime_ns == before and sorted(p.name for p in tmp_path.glob("*.js")) == ["plotly.min.js"]
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (CI installs it: apt-get install chromium)")
    dom = _chromium(tmp_path, "--dump-dom", out.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # plotly drew every figure: one SVG root per plot, the heatmap's image layer, the loss's markers
    for div in ("gg-loss", "gg-heatmap", "gg-timelines"):
        block = html[html.index(f'id="{div}"'):]
        assert 'class="main-svg"' in block[:20000], div
    assert len(re.findall(r'class="[^"]*\bjs-plotly-plot\b', html)) == 3
    assert 'class="hm"' in html  # the heatmap image
    assert html.count('class="scatterlayer') >= 2 and "rollback" in html
    assert "exploded first at step" in html or "First instability at step" in html
    shot = tmp_path / "shot.png"
    res = _chromium(tmp_path, "--window-size=1200,1800", f"--screenshot={shot}", out.as_uri())
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1800)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200  # text, lines, a colour scale: not a blank page
    white = max(colours)[0] / (img.size[0] * img.size[1])
    assert white < 0.95


def test_inline_report_is_one_file_and_cdn_needs_the_network(run_dir, tmp_path):
    inline = write_report(str(run_dir), str(tmp_path / "a" / "inline.html"), plotlyjs="inline")
    assert not (tmp_path / "a" / "plotly.min.js").exists() and os.path.getsize(inline) > 3_000_000
    cdn = write_report(str(run_dir), str(tmp_path / "b" / "cdn.html"), plotlyjs="cdn")
    assert not (tmp_path / "b" / "plotly.min.js").exists() and os.path.getsize(cdn) < 1_000_000
    assert re.search(r"""<script[^>]+src=["']https://cdn.plot.ly/""", open(cdn, encoding="utf-8").read())
    with pytest.raises(ConfigError, match="plotlyjs"):
        write_report(str(run_dir), str(tmp_path / "c.html"), plotlyjs="web")


def test_diagnosis_and_advice_of_a_real_run(run_dir):
    records = read_log(os.path.join(run_dir, "gradguard", "events.jsonl"))
    lines = diagnose(records)
    rollback = next(r for r in records if r["type"] == "action" and r["name"] == "rollback")
    first = next(r for r in records if r["type"] == "finding" and r["severity"] in ("warning", "critical"))
    assert f"at step {first['step']}" in lines[0]
    assert f"rolled back to step {rollback['params']['to_step']}" in lines[1]
    assert any("LR x" in s for s in lines)
    summary = next(r for r in records if r["type"] == "summary")
    advice = advise_from_records(records)
    assert advice == summary["advice"]  # one function: the same from the log as in the summary
    s = advice["settings"]
    cut = [r for r in records if r["type"] == "action" and r["name"] == "lower_lr"][-1]["params"]["to"]
    assert s["lr_factor"] == pytest.approx(cut, rel=0.01)  # the level that restored stability
    assert s["lr"] == [pytest.approx(1e-2 * cut, rel=0.01)]  # base LR from `start`
    assert s["max_grad_norm"] == 0.5  # the guard tightened the clip once
    assert "warmup_steps" not in s  # first instability at step 22 of 30: not an early one
    assert len(advice["lines"]) == 2


def test_advice_names_every_rung_that_fired():
    actions = [
        {"name": "lower_lr", "step": 5, "params": {"from": 1.0, "to": 0.3}},
        {"name": "recover_lr", "step": 60, "params": {"global": 0.45}},
        {"name": "tighten_clip", "step": 5, "params": {"from": 1.0, "to": 0.5}},
        {"name": "adam", "step": 9, "params": {"group0": {"beta2": [0.999, 0.95], "eps": [1e-8, 1e-6]}}},
        {"name": "lower_layer_lr", "step": 12, "params": {"rung": 3, "lm_head": 0.1, "embed": 0.1}},
        {"name": "shrink_batch", "step": 15, "params": {"batch": [64, 32], "lr_scale": 0.5}},
        {"name": "relax_clip", "step": 80, "params": {"from": 0.5, "to": 1.0}},
    ]
    out = advise(actions=actions, summary={"steps": 400, "lr_multiplier": 0.45, "max_grad_norm": 1.0},
                 config={"detect": {"warmup_steps": 20}, "lr": {"rewarm_steps": 25}, "clip": {"mode": "fixed"}},
                 optimizer={"groups": [{"lr": 6e-4}, {"lr": 1e-3}]})
    s = out["settings"]
    assert s["lr"] == [pytest.approx(1.8e-4), pytest.approx(3e-4)] and s["lr_factor"] == 0.3  # not the end's 0.45
    assert "raised it to x0.45" in out["lines"][0]
    assert s["warmup_steps"] == 25  # first instability at step 5: early; at least the guard's re-warm-up
    assert s["max_grad_norm"] == 0.5  # the tightest, though relaxed later
    assert (s["beta2"], s["eps"]) == (0.95, 1e-6)
    assert s["layer_lr_factor"] == {"lm_head": 0.1, "embed": 0.1}
    assert s["batch_size"] == 32
    assert len(out["lines"]) == 6
    quiet = advise(actions=[{"name": "recover_lr", "step": 3, "params": {}}], summary={"steps": 10, "skipped": 2})
    assert quiet["settings"] == {} and "nothing to change" in quiet["lines"][0]


def test_report_of_a_folder_without_a_log_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no events"):
        write_report(str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        cli_main(["report", str(tmp_path / "missing")])
    assert exc.value.code == 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_cli_dashboard_needs_entity_and_project_unless_dry_run(capsys):
    with pytest.raises(SystemExit):
        cli_main(["dashboard", "wandb"])
    assert "--entity and --project" in capsys.readouterr().err
    assert cli_main(["dashboard", "wandb", "--dry-run", "--prefix", "train/"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["panels"][0]["y"][0] == "train/gradguard/loss"


def test_the_console_summary_prints_the_advice_only_when_there_is_some():
    import io

    from gradguard.sinks import ConsoleSink

    advice = advise(actions=[{"name": "lower_lr", "step": 3, "params": {"to": 0.03}}],
                    summary={"steps": 200, "lr_multiplier": 0.03, "max_grad_norm": 1.0},
                    optimizer={"groups": [{"lr": 0.1}]})
    out = io.StringIO()
    ConsoleSink(stream=out).close({"steps": 200, "actions": {"lower_lr": 1}, "advice": advice})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[gradguard] summary:")
    assert lines[1] == "[gradguard] next run: " + advice["lines"][0] and "0.1 -> 0.003" in lines[1]
    quiet = io.StringIO()
    ConsoleSink(stream=quiet).close({"steps": 5, "advice": advise(actions=[], summary={"steps": 5})})
    assert len(quiet.getvalue().splitlines()) == 1


def test_the_advice_of_a_resumed_run_still_sees_the_actions_before_the_resume(tmp_path):
    """The guard's state keeps the actions the advice reads (``action_log``): a guard restored from
    it advises what the uninterrupted one does."""
    import gradguard as gg
    from gradguard.data import BatchController

    from .engines import BS, Data, Net, cfg, make_opt, run_plain

    c = cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1})
    rec = run_plain(tmp_path, c, steps=8, faults={4: 50.0, 5: 50.0}, save_at=6)
    state = json.loads(json.dumps(rec.saved_state))  # JSON-safe, as checkpoints hold it
    assert {"rollback", "lower_lr"} <= {a["name"] for a in state["action_log"]}
    assert all(set(a) == {"name", "step", "params"} for a in state["action_log"])
    want = rec.core.summary()["advice"]["settings"]
    assert want.get("lr_factor") is not None and want["lr_factor"] < 1
    net = Net()
    fresh = gg.Guard(net, make_opt(net.parameters(), "adamw"), config=c,  # the same optimizer settings
                     batches=BatchController(Data(), BS, shuffle=False))
    fresh.load_state_dict(state)
    assert fresh.core.summary()["advice"]["settings"] == want
    fresh.close()
