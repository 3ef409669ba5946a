"""A tiny byte-level GPT and an offline text corpus, used by the demo, examples and benchmarks.

Nothing here is downloaded: the corpus is read from the Python standard library's own sources.
"""

from __future__ import annotations

import math
import os
import sysconfig

import torch
from torch import nn
from torch.nn import functional as F

#: Standard-library modules whose sources form the default corpus (present on every CPython).
CORPUS_MODULES = (
    "argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py",
    "logging/__init__.py", "pathlib.py", "subprocess.py", "threading.py", "typing.py",
    "json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "enum.py", "random.py",
    "statistics.py", "fractions.py", "decimal.py", "heapq.py", "bisect.py", "shutil.py",
    "tempfile.py", "zipfile.py", "tarfile.py", "ast.py", "difflib.py", "pprint.py",
)


def load_corpus(max_bytes: int = 1_500_000) -> torch.Tensor:
    """Bytes of real text (stdlib sources) as a uint8 tensor; deterministic for one Python build."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for rel in CORPUS_MODULES:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            pkg = os.path.join(root, rel.replace(".py", ""), "__init__.py")
            if not os.path.isfile(pkg):
                continue
            path = pkg
        with open(path, "rb") as fh:
            data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no standard-library sources found under {root!r} for the demo corpus")
    blob = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


class ByteBatches:
    """Deterministic random windows of a byte corpus; train/eval split by position."""

    def __init__(self, data: torch.Tensor, seq_len: int, eval_frac: float = 0.1) -> None:
        split = int(len(data) * (1 - eval_frac))
        self.train = data[:split].long()
        self.eval = data[split:].long()
        self.seq_len = seq_len

    def _windows(self, src: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        chunk = src[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def train_batch(self, batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch_size,), generator=gen)
        return self._windows(self.train, starts)

    def eval_batches(self, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        span = len(self.eval) - self.seq_len - 1
        starts = torch.linspace(0, span - 1, batch_size * n_batches).long()
        return [self._windows(self.eval, s) for s in starts.split(batch_size)]


class Block(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2 style decoder over bytes (vocab 256): embeddings, blocks.N, ln_f, lm_head."""

    def __init__(self, n_layer: int = 2, width: int = 128, n_head: int = 4, seq_len: int = 64) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(256, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, 256, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), -math.inf), 1),
                             persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        mask = self.mask[:t, :t]
        for block in self.blocks:
            h = block(h, mask)
        logits = self.lm_head(self.ln_f(h))
        if y is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    losses = [float(model(x, y)) for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
