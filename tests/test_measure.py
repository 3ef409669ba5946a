import pytest
import torch

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
