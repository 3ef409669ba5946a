"""docs/wandb.png: the W&B "training stability" panels of an offline run, drawn without a W&B server.

No W&B server is reachable where the docs are built, so this renders what the workspace
(``gradguard dashboard wandb``) shows: it trains the demo's explosive run guarded, with a
``WandbSink`` in offline mode, reads the run's history back from its ``.wandb`` file
(``tests/wandb_log.py``), draws every panel of :func:`gradguard.dashboards.panels` (the same
keys, regular expressions and log axes) with plotly, and screenshots the page in headless
Chromium. From the repository root (needs the ``wandb`` and ``report`` extras and chromium)::

    python docs/tools/wandb_view.py [--steps 250] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def train(out: str, steps: int) -> str:
    import torch

    import gradguard as gg
    from gradguard.demo import DemoSetting, train_run

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    torch.set_num_threads(1)
    cfg = gg.GuardConfig.preset("default", output={"dir": out, "console": False, "metrics_interval": 1},
                                measure={"log_interval": 10})
    sink = gg.WandbSink(project="gradguard-demo", dir=out, name="demo: explosive AdamW, guarded")
    train_run(DemoSetting(steps=steps), guard_config=cfg, out_dir=out, sinks=[sink])
    return out


def figure(history: list[dict], title: str):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from gradguard.dashboards import panels

    shown = [p for p in panels() if not p.table]
    cols = 2
    rows = math.ceil((len(shown) + 1) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[p.title for p in shown] + ["gradguard's events as points"],
                        vertical_spacing=0.045, horizontal_spacing=0.07)
    keys = sorted({k for row in history for k in row if k.startswith("gradguard/")})
    for i, panel in enumerate(shown):
        r, c = i // cols + 1, i % cols + 1
        names = panel.y if not panel.regex else [k for k in keys if re.search(panel.regex, k)]
        for key in names:
            pts = [(row["_step"], row[key]) for row in history if key in row and isinstance(row[key], (int, float))]
            if not pts:
                continue
            sparse = key.startswith("gradguard/event/")
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=key, showlegend=False,
                                     mode="markers" if sparse else "lines", hovertemplate=key + " %{y:.4g}<extra></extra>",
                                     marker={"size": 8} if sparse else None), row=r, col=c)
        if panel.log_y:
            fig.update_yaxes(type="log", row=r, col=c)
    i = len(shown)
    r, c = i // cols + 1, i % cols + 1
    for key in [k for k in keys if k.startswith("gradguard/event/")]:
        pts = [(row["_step"], row[key]) for row in history if key in row]
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="markers", name=key.rsplit("/", 1)[1],
                                 marker={"size": 10}), row=r, col=c)
    fig.update_layout(height=300 * rows, width=1400, title=title, template="plotly_white",
                      margin={"l": 50, "r": 20, "t": 80, "b": 30}, legend={"orientation": "h", "y": -0.02})
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--out", default=None, help="work folder (default: a new temporary folder)")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "wandb.png"))
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="gg-wandb-view-")
    train(out, args.steps)
    from tests.wandb_log import read_runs

    (run,) = read_runs(out)
    fig = figure(run.history, "W&B panels of the demo's explosive run, guarded (offline run, drawn with plotly)")
    html = os.path.join(out, "wandb_view.html")
    fig.write_html(html, include_plotlyjs="directory", full_html=True)
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        print(f"chromium not found: open {html}")
        return 1
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                    f"--user-data-dir={os.path.join(out, 'profile')}", "--proxy-server=127.0.0.1:9",
                    "--host-resolver-rules=MAP * ~NOTFOUND", f"--window-size=1400,{int(fig.layout.height)}",
                    "--virtual-time-budget=15000", f"--screenshot={args.png}", "file://" + html],
                   check=True, capture_output=True, timeout=180)
    print(f"run: {out}\nwritten: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
