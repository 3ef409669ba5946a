"""Regenerates the README's screenshots from a real run (CPU, ~2 minutes, needs chromium):

    python dashboards/screenshots.py [--out /tmp/gg-shots]

1. trains the demo's explosive setting (AdamW lr 0.1, no warm-up, no clipping) with the default
   guard, a JSONL log and a TensorBoardSink;
2. ``gradguard report`` of that run -> ``docs/report.png`` (headless Chromium, network blocked);
3. the real ``tensorboard`` served on 127.0.0.1, its CUSTOM SCALARS tab (the layout the sink
   wrote) -> ``docs/tensorboard.png``;
4. the W&B workspace's panel list -> ``dashboards/wandb/panels.md`` and its spec ->
   ``dashboards/wandb/workspace.json`` (no server: ``gradguard dashboard wandb --dry-run``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OFFLINE = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium(url: str, png: str, size: str, profile: str, block_network: bool, budget_ms: int) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("chromium not found (apt-get install -y chromium)")
    flags = OFFLINE + [f"--user-data-dir={profile}", f"--window-size={size}", f"--virtual-time-budget={budget_ms}",
                       f"--screenshot={png}"]
    if block_network:
        flags += ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]
    else:  # localhost only (tensorboard): no proxy for it, nothing else resolves
        flags += ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
    subprocess.run([exe, *flags, url], check=True, capture_output=True, timeout=180)


def train(out: str, steps: int, threads: int) -> str:
    import torch

    from gradguard import GuardConfig, TensorBoardSink
    from gradguard.demo import DemoSetting, train_run

    torch.set_num_threads(threads)
    cfg = GuardConfig.preset("default", output={"dir": out, "console": False, "metrics_interval": 1},
                             measure={"log_interval": 10})
    r = train_run(DemoSetting(steps=steps), guard_config=cfg, out_dir=out,
                  sinks=[TensorBoardSink(os.path.join(out, "tb"))])
    return r["guard"]["log"]


def write_wandb_files() -> None:
    """dashboards/wandb/workspace.json (the --dry-run spec) and panels.md (its panel list)."""
    from gradguard.dashboards import panels, wandb_workspace_spec

    wdir = os.path.join(ROOT, "dashboards", "wandb")
    os.makedirs(wdir, exist_ok=True)
    spec = wandb_workspace_spec()
    # panel ids are random per build: left out so that the committed file changes only with the panels
    for section in spec["view"]["spec"]["section"]["panelBankConfig"]["sections"]:
        for panel in section.get("panels", []):
            panel.pop("__id__", None)
    with open(os.path.join(wdir, "workspace.json"), "w", encoding="utf-8") as fh:
        json.dump(spec, fh, indent=1)
        fh.write("\n")
    rows = ["| section | panel | metrics | y axis |", "|---|---|---|---|"]
    for pn in panels():
        if pn.table:
            rows.append(f"| {pn.section} | {pn.title} | table `{pn.table}` (scatter: step, loss) | linear |")
            continue
        what = f"regex `{pn.regex}`" if pn.regex else ", ".join(f"`{n}`" for n in pn.y)
        rows.append(f"| {pn.section} | {pn.title} | {what} | {'log' if pn.log_y else 'linear'} |")
    with open(os.path.join(wdir, "panels.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(rows) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--wandb-only", action="store_true", help="only rewrite dashboards/wandb/ (no run)")
    p.add_argument("--reuse", action="store_true", help="reuse the run already in --out (no training)")
    args = p.parse_args()
    if args.wandb_only:
        write_wandb_files()
        return 0
    out = args.out or tempfile.mkdtemp(prefix="gg-shots-")
    docs = os.path.join(ROOT, "docs")
    os.makedirs(docs, exist_ok=True)
    if args.reuse:
        from gradguard.report import find_log

        log = find_log(out)
    else:
        log = train(out, args.steps, args.threads)
    from gradguard.report import write_report

    report = write_report(log, os.path.join(out, "report.html"))
    chromium("file://" + report, os.path.join(docs, "report.png"), "1280,2300", os.path.join(out, "p1"), True, 15000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", os.path.join(out, "tb"),
                           "--host", "127.0.0.1", "--port", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugins_listing", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        chromium(f"http://127.0.0.1:{port}/?darkMode=false#custom_scalars", os.path.join(docs, "tensorboard.png"),
                 "1400,1100", os.path.join(out, "p2"), False, 20000)
    finally:
        tb.terminate()
        tb.wait(timeout=30)
    write_wandb_files()
    print(f"run: {out}\nreport: {report}\nwritten: docs/report.png, docs/tensorboard.png, dashboards/wandb/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
