import pytest
import torch
from torch import nn

from gradguard.measure import GradMeasurer, LayerMap, default_layer_name, metric_key

from .conftest import make_batch


@pytest.mark.parametrize("name,layer", [
    ("transformer.wte.weight", "transformer.wte"),
    ("transformer.h.3.attn.c_attn.weight", "transformer.h.3"),
    ("transformer.ln_f.bias", "transformer.ln_f"),
    ("lm_head.weight", "lm_head"),
    ("model.layers.11.self_attn.q_proj.weight", "model.layers.11"),
    ("model.embed_tokens.weight", "model.embed_tokens"),
    ("module._orig_mod.model.norm.weight", "model.norm"),
    ("0.weight", "0"),
    ("bias", "bias"),
])
def test_default_grouping(name, layer):
    assert default_layer_name(name) == layer


def test_metric_key_has_no_dots():
    assert metric_key("transformer.h.3") == "transformer_h_3"


def test_layer_norms_match_manual_and_total_matches_clip_grad_norm(tiny):
    gen = torch.Generator().manual_seed(0)
    tiny(*make_batch(gen)).backward()
    layers = LayerMap(tiny)
    assert layers.layer_names == ["embed", "blocks.0", "blocks.1", "norm", "lm_head"]
    m = GradMeasurer(layers).measure([torch.tensor(3.5)])
    for name, got in zip(layers.layer_names, m.layer_norms):
        grads = [p.grad.flatten() for n, p in tiny.named_parameters() if default_layer_name(n) == name]
        assert got == pytest.approx(torch.cat(grads).norm().item(), rel=1e-5)
    ref = torch.nn.utils.clip_grad_norm_(tiny.parameters(), float("inf")).item()
    assert m.total_norm == pytest.approx(ref, rel=1e-5)
    assert m.extras == [3.5] and m.nonfinite_layers == []


def test_one_transfer_per_measure_and_fallback(tiny, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    tiny(*make_batch(gen)).backward()
    meas = GradMeasurer(LayerMap(tiny))
    calls = []
    orig = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or orig(self))
    fused = meas.measure([1.0, None])
    assert len(calls) == 1 and meas.transfers == 1

    def broken(*a, **k):
        raise RuntimeError("no fused kernel")

    monkeypatch.setattr(torch, "_foreach_norm", broken)
    slow = meas.measure([1.0, None])
    assert slow.layer_norms == pytest.approx(fused.layer_norms, rel=1e-6)
    assert slow.extras[0] == 1.0 and slow.extras[1] != slow.extras[1]  # None -> nan


def test_nonfinite_layers_named(tiny):
    gen = torch.Generator().manual_seed(0)
    tiny(*make_batch(gen)).backward()
    tiny.blocks[1][0].weight.grad[0, 0] = float("nan")
    m = GradMeasurer(LayerMap(tiny)).measure()
    assert m.nonfinite_layers == ["blocks.1"]
    assert m.total_norm != m.total_norm


def test_regex_and_callable_override(tiny):
    by_regex = LayerMap(tiny, r"^(blocks|embed|norm|lm_head)")
    assert by_regex.layer_names == ["embed", "blocks", "norm", "lm_head"]
    by_fn = LayerMap(tiny, lambda n: "head" if n.startswith("lm_head") else "body")
    assert by_fn.layer_names == ["body", "head"]


def test_flat_parameter_slices_are_measured_per_original_parameter_with_layers_alike_on_every_rank(monkeypatch):
    """An FSDP1 flat parameter (``use_orig_params=False``) as one process of two holds it: the
    Linear's weight and bias are here, the LayerNorm's pieces on the other process. The layer list
    and the normalization layers come from every piece (the same on every process: the step's
    packed reduction and the takeover rule line up across ranks); only the pieces held here are
    measured, each on its own slice, and a clip scales the flat gradient once."""
    import gradguard._compat as compat
    from gradguard.measure import norm_layers

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.ln = nn.LayerNorm(2)

    net = Net()
    root = nn.Module()
    root.net = net
    flat = nn.Parameter(torch.zeros(10))  # fc.weight (6) + fc.bias (2) + padding (2); ln elsewhere
    root.register_parameter("_flat_param", flat)
    for name in ("fc", "ln"):  # FSDP1 removes the original parameters from their modules
        for pname in ("weight", "bias"):
            delattr(getattr(net, name), pname)
    P = compat.FlatPiece
    pieces = [P(flat, "net.fc.weight", 0, 6, (2, 3), net.fc), P(flat, "net.fc.bias", 6, 2, (2,), net.fc),
              P(flat, "net.ln.weight", 0, 0, (2,), net.ln), P(flat, "net.ln.bias", 0, 0, (2,), net.ln)]
    monkeypatch.setattr(compat, "fsdp1_flat_pieces", lambda model: pieces)
    layers = LayerMap(root)
    assert layers.layer_names == ["net.fc", "net.ln"] and layers.param_names == ["net.fc.weight", "net.fc.bias"]
    assert norm_layers(root, layers) == ["net.ln"]  # held by the other process, still named here
    assert layers.unique_params() == [flat] and layers.params_of(["net.fc"]) == [flat]
    flat.grad = torch.arange(10, dtype=torch.float32)
    m = GradMeasurer(layers).measure()
    assert m.layer_norms[0] == pytest.approx(float(torch.arange(8.0).norm()))  # the padding left out
    assert m.layer_norms[1] == 0.0
    (t,) = layers.tensors([1])
    t.fill_(5.0)  # a view: writes land in the flat parameter's slice
    assert flat.detach()[6:8].tolist() == [5.0, 5.0] and flat.detach()[8:].tolist() == [0.0, 0.0]
    meas = GradMeasurer(layers)
    meas.measure()
    assert len(meas.last_grads) == 1 and meas.last_grads[0] is flat.grad  # a clip scales it once
