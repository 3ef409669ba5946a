"""The TensorBoard pages of a guarded run: the real ``tensorboard`` server on 127.0.0.1, its CUSTOM
SCALARS and TEXT pages opened in real headless Chromium, read after TensorBoard's own JavaScript drew
them (its dashboards live in shadow DOM, which ``--dump-dom`` does not reach: the page is read over
the DevTools protocol on a pipe, no extra package), and the JSON the pages are drawn from."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import gradguard as gg
from gradguard.dashboards import LINE_CHARTS, LINES_DIR, LINES_TAG, LR_LOG10_CHART, tensorboard_layout
from gradguard.sinks import M

from .test_sinks import NAN_STEP, _run_guard

pytest.importorskip("tensorboard")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.usefixtures("one_thread")

ACTIONS = ("rollback", "lower_lr", "tighten_clip")  # what the NaN streak of _run_guard brings, at NAN_STEP
EMPTY_IN_THIS_RUN = {"loss scale (fp16)", "per-layer update/weight ratio", "per-layer parameter norm"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A guarded run with a TensorBoardSink, served by ``python -m tensorboard.main``; its base URL."""
    out = tmp_path_factory.mktemp("tbpage")
    mem = _run_guard(out, gg.TensorBoardSink(str(out / "tb")))
    assert set(ACTIONS) <= set(mem.summary["actions"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(out / "tensorboard.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out / "tb"), "--host",
                             "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/data/plugins_listing", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("tensorboard did not serve: " + (out / "tensorboard.log").read_text()[-2000:])
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_tensorboard_serves_the_layout_tags_and_action_lines(server):
    """What the pages are drawn from: the layout the sink wrote, a scalar for every chart, and the
    text of the actions' step, one line per action."""
    import re

    layout = _get(server + "/data/plugin/custom_scalars/layout")
    got = {c["title"]: {ch["title"]: ch["multiline"]["tag"] for ch in c["chart"]} for c in layout["category"]}
    assert got == {cat: {t: spec[1] for t, spec in charts.items()} for cat, charts in tensorboard_layout().items()}
    tags = _get(server + "/data/plugin/scalars/tags")
    assert f"{M.LR_LOG10}/group0" in tags["."]  # the run's own keys are all there
    # ... and the line runs inside the run's folder (at most 7: a colour each), which hold the
    # series of the multi-line charts, each under a tag of its own; a chart's series in different runs
    lines = {run: set(t) for run, t in tags.items() if run.startswith(LINES_DIR + "/")}
    assert set(tags) == {".", *lines} and set(lines) <= {f"{LINES_DIR}/{n}" for n in range(7)}
    run_of = {tag: run for run, t in lines.items() for tag in t}
    assert run_of[f"{LINES_TAG}/layer_grad_norm/grad_norm/fc1"] != run_of[f"{LINES_TAG}/layer_grad_norm/grad_norm/head"]
    assert f"{LINES_TAG}/lr_log10/lr_log10/group0" in run_of
    scalars = set().union(*tags.values())
    for charts in got.values():
        for title, tags in charts.items():
            drawn = any(re.search(t, s) for t in tags for s in scalars)
            assert drawn == (title not in EMPTY_IN_THIS_RUN), (title, tags)
    tag = gg.TensorBoardSink.TEXT_TAG + "/text_summary"  # torch's add_text adds /text_summary
    assert tag in _get(server + "/data/plugin/text/tags")["."]
    (entry,) = [e for e in _get(f"{server}/data/plugin/text/text?run=.&tag={tag}") if e["step"] == NAN_STEP]
    assert [a in entry["text"] for a in ACTIONS] == [True] * 3 and entry["text"].count("<br") == 2


def _rgb(colour: str) -> str:
    """A CSS colour (``#rrggbb`` or ``rgb(r, g, b)``) as ``rgb(r, g, b)``."""
    if colour.startswith("#") and len(colour) == 7:
        return "rgb({}, {}, {})".format(*(int(colour[i:i + 2], 16) for i in (1, 3, 5)))
    return colour.replace(" ", "").replace(",", ", ")


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    commands on fd 3, replies on fd 4, each a JSON message ended by a NUL byte). Only 127.0.0.1
    resolves; nothing else is reachable."""

    def __init__(self, profile: str, size: tuple[int, int] = (1400, 1100)) -> None:
        child_in, self._w = os.pipe()
        self._r, child_out = os.pipe()

        def fds() -> None:  # in the child, before exec: the pipes at fds 3 and 4
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", f"--window-size={size[0]},{size[1]}",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(child_in)
        os.close(child_out)
        self.size = size
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def send(self, method: str, params: dict | None = None, *, browser: bool = False) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not browser:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url}, browser=True)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 browser=True)["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.size[0], "height": self.size[1],
                                                         "deviceScaleFactor": 1, "mobile": False})

    # the page's visible text, whitespace collapsed, shadow roots included (TensorBoard's dashboards
    # are Polymer elements); a <br> is BR
    TEXT = """(() => { const out = []; const walk = (n) => { if (n.shadowRoot) walk(n.shadowRoot);
      for (const c of n.childNodes) { if (c.nodeType === 3) out.push(c.textContent);
        else if (c.nodeName === 'BR') out.push('\\u2028');
        else if (!['STYLE', 'SCRIPT', 'TEMPLATE', 'NOSCRIPT'].includes(c.nodeName)) walk(c); } };
      walk(document); return out.join(' ').replace(/[ \\t\\r\\n]+/g, ' '); })()"""
    BR = "\u2028"

    def text_when(self, *needles: str, timeout: float = 90.0) -> str:
        """The page's text once it holds every needle (TensorBoard fetches, then draws)."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.send("Runtime.evaluate", {"expression": self.TEXT, "returnByValue": True})
            text = res.get("result", {}).get("value") or ""
            if all(n in text for n in needles) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    # every custom-scalars chart card: its title, the series of its "Matches" list (less the marker
    # symbol) with the colour TensorBoard gives each, and the stroke colours of the lines in its SVG
    CHARTS = """(() => { const cards = []; const walk = (n) => { if (n.shadowRoot) walk(n.shadowRoot);
      for (const c of n.children || []) { if (c.localName === 'tf-custom-scalar-multi-line-chart-card') cards.push(c);
        walk(c); } }; walk(document);
      return cards.map((card) => { const root = card.shadowRoot; const strokes = [];
        const lines = (n) => { if (n.shadowRoot) lines(n.shadowRoot); for (const c of n.children || []) {
          const stroke = c.getAttribute('stroke') || c.style.stroke;
          if (c.localName === 'path' && c.classList.contains('line') && c.getAttribute('d') && stroke) strokes.push(stroke);
          lines(c); } }; lines(root);
        return {title: card.title, strokes,
                series: [...root.querySelectorAll('.match-list-entry')].map((e) =>
                  [e.textContent.replace(/\\s+/g, ' ').trim().replace(/^[^\\w.]+ /, ''), e.style.color])}; }); })()"""

    def charts(self) -> dict[str, dict]:
        """The chart cards by title (see ``CHARTS``); colours as ``rgb(r, g, b)``."""
        res = self.send("Runtime.evaluate", {"expression": self.CHARTS, "returnByValue": True})
        out = {}
        for card in res.get("result", {}).get("value") or []:
            card["strokes"] = [_rgb(c) for c in card["strokes"]]
            card["series"] = {name: _rgb(colour) for name, colour in card["series"]}
            out[card["title"]] = card
        return out

    def screenshot(self, path: str) -> None:
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", browser=True)
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


def _check_colours(browser: Chromium, timeout: float = 60.0) -> None:
    """A colour per series: in every multi-line chart the series of the "Matches" list have
    different colours (TensorBoard colours by run: each series is a run of its own), and the lines
    drawn in the chart's SVG have those colours (polled: the lines come after the list)."""
    deadline = time.monotonic() + timeout
    while True:
        cards = browser.charts()
        per_layer = cards.get("per-layer grad norm", {"series": {}, "strokes": []})
        drawn = set(per_layer["strokes"]) == set(per_layer["series"].values()) and len(per_layer["series"]) == 2
        if drawn or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert drawn, per_layer  # fc1 and head: two lines drawn in the colours of the list ...
    assert len(set(per_layer["strokes"])) == 2, per_layer  # ... two colours, not one
    multi = 0
    for title, card in cards.items():
        colours = list(card["series"].values())
        assert len(set(colours)) == len(colours), (title, card["series"])  # at most 7: TensorBoard's palette
        assert set(card["strokes"]) <= set(colours), (title, card)
        multi += title in LINE_CHARTS and len(colours) > 1
    assert multi >= 6, cards  # loss + events, grad norm + clip, LR, counts, actions, events, per-layer


def test_the_tensorboard_pages_show_gradguards_charts_and_actions_in_headless_chromium(server, tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (CI installs it: apt-get install chromium)")
    charts = [title for cat in tensorboard_layout().values() for title in cat]
    browser = Chromium(str(tmp_path / "profile"))
    try:
        browser.open(server + "/?darkMode=false#custom_scalars")

        def series(chart: str, key: str) -> str:  # a series' entry in a chart's "Matches" list: tag (run)
            return f"{LINES_TAG}/{chart}/{key[len('gradguard/'):]} ({LINES_DIR}/"

        lr10 = series("lr_log10", f"{M.LR_LOG10}/group0")
        fc1, head = (series("layer_grad_norm", f"{M.GRAD_NORM_LAYER}/{layer}") for layer in ("fc1", "head"))
        page = browser.text_when(LR_LOG10_CHART, lr10, "per-layer parameter norm", fc1, head,
                                 *(series("actions", f"{M.ACTION}/{name}") for name in ACTIONS),
                                 *(series("events", f"{M.EVENT}/{name}") for name in ACTIONS))
        for title in [*tensorboard_layout(), *charts]:
            assert title in page, title
        # each chart lists the series it drew: the LR's log10 in its own chart, the per-layer lines
        # without the total, the actions' cumulative counts
        after = page[page.index(LR_LOG10_CHART):]
        assert after.index("Matches (1)") < after.index(lr10) < after.index("LR multiplier")
        per_layer = page[page.index("per-layer grad norm"):page.index("per-layer update/weight ratio")]
        assert "Matches (2)" in per_layer and "grad_norm/total" not in per_layer
        assert f"{M.LR_MULT} (.)" in page  # a one-series chart draws the run's own key
        _check_colours(browser)
        shot = tmp_path / "custom_scalars.png"
        browser.screenshot(str(shot))

        browser.open(server + "/?darkMode=false#text")
        page = browser.text_when(*ACTIONS, "WARN")
        lines = [ln.strip() for ln in page.split(Chromium.BR) if f"step {NAN_STEP}: " in ln]
        # one line per action on the TEXT tab (the step's three actions are not one line)
        for name in ACTIONS:
            assert sum(f"step {NAN_STEP}: {name} " in ln for ln in lines) == 1, (name, lines)
        assert "WARN gradguard: rollback" in page  # the alert
    finally:
        browser.close()
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 1100)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200  # axes, lines, text: not a blank page
    assert max(colours)[0] / (img.size[0] * img.size[1]) < 0.95
