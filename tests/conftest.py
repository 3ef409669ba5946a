import os

import pytest
import torch
from torch import nn

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


class TinyNet(nn.Module):
    """Embedding -> 2 blocks -> head, named like a transformer so layer grouping is exercised."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        logits = self.lm_head(self.norm(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def make_batch(gen: torch.Generator, bs: int = 8, t: int = 6, vocab: int = 32):
    x = torch.randint(0, vocab, (bs, t), generator=gen)
    return x, (x + 1) % vocab


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is several times faster than two on a shared CPU.
    Modules of real-engine runs use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return TinyNet()


@pytest.fixture
def quiet_cfg(tmp_path):
    import gradguard as gg

    def make(preset: str = "default", **over):
        over.setdefault("output", {})
        over["output"] = {"dir": str(tmp_path), "console": False, **over["output"]}
        return gg.GuardConfig.preset(preset, **over)

    return make


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """W&B in offline mode writing under the test's tmp_path (read back with tests/wandb_log.py)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "gradguard-test")
    wandb.teardown()  # wandb keeps the settings (WANDB_DIR) of its first run in the process: start over
    yield wandb
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()
