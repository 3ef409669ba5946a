"""The engine-suite harness (benchmarks/engine_suites): a tiny suite of Trainer tests run without and
with the callback through the real plugin, then compared. Monitor mode must leave every weight, logged
value and argument bit-identical, and a test that asserts the exact callback list must show up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = os.path.join(ROOT, "benchmarks", "engine_suites")
sys.path.insert(0, SUITES)

import compare  # noqa: E402

SUITE = '''
import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer import DEFAULT_CALLBACKS


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        y = self.lin(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(y, labels), "logits": y}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(48, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.01 * torch.randn(48, generator=g)

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def make(tmp_path):
    torch.manual_seed(0)
    args = TrainingArguments(str(tmp_path), max_steps=6, save_steps=3, logging_steps=1, per_device_train_batch_size=8,
                             learning_rate=1e-2, report_to=[], disable_tqdm=True, eval_strategy="steps",
                             eval_steps=3, use_cpu=True)
    return Trainer(Model(), args, train_dataset=Data(), eval_dataset=Data())


def test_train_and_resume(tmp_path):
    make(tmp_path).train()
    make(tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


def test_exact_callback_list(tmp_path):
    names = sorted(type(cb).__name__ for cb in make(tmp_path).callback_handler.callbacks)
    assert names == sorted([c.__name__ for c in DEFAULT_CALLBACKS] + ["PrinterCallback"])
'''


def _run(tmp_path, mode: str) -> None:
    env = dict(os.environ, GG_ATTACH="" if mode == "none" else mode, OMP_NUM_THREADS="1",
               GG_RECORD=str(tmp_path / "out" / f"test_tiny-{mode}.jsonl"),
               PYTHONPATH=os.pathsep.join([SUITES, ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hf_attach", "-p", "no:cacheprovider",
                    "-o", "addopts=", f"--junitxml={tmp_path / 'out' / f'junit-test_tiny-{mode}.xml'}",
                    str(tmp_path / "suite" / "test_tiny.py")], env=env, cwd=tmp_path, capture_output=True,
                   text=True, timeout=600)


def test_monitor_is_transparent_to_the_trainers_own_tests(tmp_path, capsys):
    (tmp_path / "suite").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "suite" / "test_tiny.py").write_text(SUITE)
    for mode in ("none", "monitor"):
        _run(tmp_path, mode)
    out = tmp_path / "out"
    base = compare.outcomes(str(out / "junit-test_tiny-none.xml"))
    mon = compare.outcomes(str(out / "junit-test_tiny-monitor.xml"))
    assert set(base.values()) == {"passed"} and len(base) == 2
    # the callback list is the one thing monitor mode visibly changes
    assert [t.split("::")[-1] for t in base if mon.get(t) != "passed"] == ["test_exact_callback_list"]
    base_rec = compare.records(str(out / "test_tiny-none.jsonl"))
    mon_rec = compare.records(str(out / "test_tiny-monitor.jsonl"))
    assert len(base_rec) == 2 and set(base_rec) == set(mon_rec)  # train() and the resumed train()
    assert all("guard" in r for r in mon_rec.values()) and not any("guard" in r for r in base_rec.values())
    assert any(e.get("grad_norm") for r in base_rec.values() for e in r["log_history"])
    # same weights, same logged values (loss, grad_norm, learning_rate, eval_loss), same arguments
    assert compare.record_diffs(base_rec, mon_rec) == []
    compare.main(str(out))
    table = capsys.readouterr().out
    assert "| test_tiny" in table and "test_tiny::test_exact_callback_list" in table
