import json

import pytest

import gradguard as gg
from gradguard.config import PRESETS

INVALID = [
    ({"detect": {"loss_sigma": -1.0}}, "GuardConfig.detect.loss_sigma", "-1.0"),
    ({"detect": {"loss_ratio": 0.5}}, "GuardConfig.detect.loss_ratio", "0.5"),
    ({"detect": {"ema_alpha": 1.5}}, "GuardConfig.detect.ema_alpha", "1.5"),
    ({"detect": {"warmup_steps": 2.5}}, "GuardConfig.detect.warmup_steps", "2.5"),
    ({"detect": {"overflow_rate": 0}}, "GuardConfig.detect.overflow_rate", "0"),
    ({"clip": {"mode": "zclip"}}, "GuardConfig.clip.mode", "'zclip'"),
    ({"clip": {"max_norm": 0}}, "GuardConfig.clip.max_norm", "0"),
    ({"clip": {"floor": 5.0}}, "GuardConfig.clip.floor", "5.0"),
    ({"clip": {"tighten_factor": 1.0}}, "GuardConfig.clip.tighten_factor", "1.0"),
    ({"lr": {"down_factor": 2}}, "GuardConfig.lr.down_factor", "2"),
    ({"lr": {"recover_factor": 0.9}}, "GuardConfig.lr.recover_factor", "0.9"),
    ({"lr": {"layer_groups": {"emb": "("}}}, "GuardConfig.lr.layer_groups['emb']", "'('"),
    ({"adam": {"beta2": 1.0}}, "GuardConfig.adam.beta2", "1.0"),
    ({"adam": {"eps": -1e-8}}, "GuardConfig.adam.eps", "-1e-08"),
    ({"policy": {"ladder": []}}, "GuardConfig.policy.ladder", "[]"),
    ({"policy": {"ladder": [["explode"]]}}, "GuardConfig.policy.ladder[0]", "'explode'"),
    ({"policy": {"act": "yes"}}, "GuardConfig.policy.act", "'yes'"),
    ({"policy": {"max_skip_streak": 0}}, "GuardConfig.policy.max_skip_streak", "0"),
    ({"recovery": {"ring_size": 0}}, "GuardConfig.recovery.ring_size", "0"),
    ({"measure": {"layer_pattern": "(["}}, "GuardConfig.measure.layer_pattern", "'(['"),
    ({"output": {"metrics_interval": 0}}, "GuardConfig.output.metrics_interval", "0"),
    ({"clip": {"maxnorm": 1.0}}, "GuardConfig.clip.maxnorm", "1.0"),
    ({"clipping": {}}, "GuardConfig.clipping", "{}"),
    # on/off fields take real booleans only: "false" / "no" / 1 used to read as True
    ({"output": {"console": "false"}}, "GuardConfig.output.console", "'false'"),
    ({"output": {"jsonl": "no"}}, "GuardConfig.output.jsonl", "'no'"),
    ({"policy": {"act": 1}}, "GuardConfig.policy.act", "1"),
    ({"policy": {"skip_nonfinite": 0}}, "GuardConfig.policy.skip_nonfinite", "0"),
    ({"recovery": {"restore_rng": "true"}}, "GuardConfig.recovery.restore_rng", "'true'"),
    ({"recovery": {"restore_schedule": None}}, "GuardConfig.recovery.restore_schedule", "None"),
    ({"recovery": {"oom_all_ranks": "yes"}}, "GuardConfig.recovery.oom_all_ranks", "'yes'"),
    # numeric strings parse; other strings are a clear error
    ({"adam": {"eps": "tiny"}}, "GuardConfig.adam.eps", "'tiny'"),
    ({"policy": {"max_skip_streak": "2.5"}}, "GuardConfig.policy.max_skip_streak", "'2.5'"),
    ({"recovery": {"disk_dir": 3}}, "GuardConfig.recovery.disk_dir", "3"),
    ({"output": {"dir": ""}}, "GuardConfig.output.dir", "''"),
]


@pytest.mark.parametrize("data,field,value", INVALID)
def test_invalid_config_names_field_value_and_fix(data, field, value):
    with pytest.raises(gg.ConfigError) as info:
        gg.GuardConfig.from_dict(data)
    msg = str(info.value)
    assert msg.startswith(f"{field}={value}"), msg
    assert "Fix:" in msg


def test_unknown_preset():
    with pytest.raises(gg.ConfigError, match="unknown preset.*Fix"):
        gg.GuardConfig.preset("turbo")


def test_default_is_default_preset_and_monitor_observes_only():
    assert gg.GuardConfig().to_dict() == gg.GuardConfig.preset("default").to_dict()
    mon = gg.GuardConfig.preset("monitor")
    assert mon.policy.act is False and mon.clip.mode == "off"
    for name in PRESETS:
        gg.GuardConfig.preset(name)


def test_dict_json_yaml_round_trip(tmp_path):
    cfg = gg.GuardConfig.preset("default", clip={"max_norm": 0.5}, lr={"down_factor": 0.25})
    d = cfg.to_dict()
    assert gg.GuardConfig.from_dict(d).to_dict() == d
    (tmp_path / "c.json").write_text(json.dumps(d))
    assert gg.GuardConfig.from_yaml(str(tmp_path / "c.json")).to_dict() == d
    (tmp_path / "c.yaml").write_text("preset: adaptive\nclip:\n  max_norm: 0.3\n")
    y = gg.GuardConfig.from_yaml(str(tmp_path / "c.yaml"))
    assert y.clip.mode == "adaptive" and y.clip.max_norm == 0.3


def test_every_field_documented():
    import ast
    import inspect

    from gradguard import config

    tree = ast.parse(inspect.getsource(config))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and node.name != "ConfigError":
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, (ast.Constant, ast.BinOp)), (
                        f"{node.name}.{stmt.target.id} has no docstring")


def test_yaml_numeric_strings_parse_and_yaml_booleans_are_accepted(tmp_path):
    pytest.importorskip("yaml")
    # PyYAML (YAML 1.1) reads 1e-6 as the *string* '1e-6'; quoted numbers are strings too
    (tmp_path / "c.yaml").write_text(
        "adam:\n  eps: 1e-6\nclip:\n  max_norm: '0.5'\npolicy:\n  max_skip_streak: '30'\n  act: no\n"
        "output:\n  console: off\n  jsonl: true\n"
    )
    cfg = gg.GuardConfig.from_yaml(str(tmp_path / "c.yaml"))
    assert cfg.adam.eps == 1e-6 and isinstance(cfg.adam.eps, float)
    assert cfg.clip.max_norm == 0.5
    assert cfg.policy.max_skip_streak == 30 and isinstance(cfg.policy.max_skip_streak, int)
    assert cfg.policy.act is False and cfg.output.console is False and cfg.output.jsonl is True
    (tmp_path / "bad.yaml").write_text("output:\n  console: 'false'\n")
    with pytest.raises(gg.ConfigError, match=r"GuardConfig.output.console='false': must be a bool.*Fix"):
        gg.GuardConfig.from_yaml(str(tmp_path / "bad.yaml"))
