"""The JSONL event log against the JSON Schema shipped in the package, for every engine."""

from __future__ import annotations

import json

import pytest

from gradguard.sinks import EVENT_SCHEMA_VERSION, event_schema

from .test_contract import ENGINES, RUNNERS, cfg

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_schema_is_a_valid_draft_2020_12_schema_and_rejects_bad_records():
    schema = event_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    assert not v.is_valid({"type": "skip", "step": 3, "time": 1.0, "finding_ids": []})  # no reason
    assert not v.is_valid({"type": "metrics", "step": 3, "gradguard/grad_norm/h.0": 1.0})  # a dot in a name
    assert not v.is_valid({"type": "action", "step": 3, "time": 1.0, "name": "skip", "reason": "",
                           "params": {}, "finding_ids": [0]})  # ids start at 1
    assert v.is_valid({"type": "resume", "step": 5, "time": 1.0, "restored": True})  # adapters' own events


@pytest.mark.parametrize("engine", ENGINES)
def test_every_record_of_every_engine_validates(tmp_path, engine):
    c = cfg(tmp_path, recovery={"snapshot_interval": 3, "confirm_steps": 1})
    rec = RUNNERS[engine](tmp_path, c, steps=12, faults={4: float("nan"), 8: 50.0, 9: 50.0})
    assert rec.error is None
    with open(rec.core.log_path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    validator = jsonschema.Draft202012Validator(event_schema())
    for r in records:
        errors = [e.message for e in validator.iter_errors(r)]
        assert not errors, (r, errors)
    kinds = {r["type"] for r in records}
    assert {"start", "metrics", "finding", "action", "skip", "summary"} <= kinds
    start = records[0]
    assert start["type"] == "start" and start["schema_version"] == EVENT_SCHEMA_VERSION
    want = {"plain": "torch", "hf": "transformers", "lightning": "lightning"}[engine]
    assert want in start["versions"] and "gradguard" in start["versions"]
    findings = {r["id"]: r for r in records if r["type"] == "finding"}
    assert len(findings) == sum(r["type"] == "finding" for r in records)  # ids are unique
    # the NaN step: a skip record with its reason, pointing at the non-finite-loss finding
    skip4 = [r for r in records if r["type"] == "skip" and r["step"] == 4]
    assert len(skip4) == 1 and "non-finite" in skip4[0]["reason"]
    assert "nonfinite_loss" in [findings[i]["kind"] for i in skip4[0]["finding_ids"]]
    # the escalation's actions reference the findings of their own step
    answered = [r for r in records if r["type"] == "action" and r["finding_ids"]]
    assert answered and any(r["name"] == "rollback" for r in answered)
    for r in answered:
        assert all(findings[i]["step"] == r["step"] for i in r["finding_ids"])
    # loss spikes name the layers whose norms moved most
    spikes = [f for f in findings.values() if f["kind"] == "loss_spike"]
    assert spikes and all(f["moved_layers"] for f in spikes)
    assert set().union(*(f["moved_layers"] for f in spikes)) <= set(start["layers"])


def test_a_halt_validates_and_its_diagnosis_carries_the_advice(tmp_path):
    c = cfg(tmp_path, policy={"ladder": [["lower_lr", "tighten_clip"], ["halt"]], "cooldown": 1},
            recovery={"snapshot_interval": 0},
            output={"halt_raises": False})
    with pytest.warns(Warning, match="gradguard halted"):
        rec = RUNNERS["plain"](tmp_path, c, steps=14, faults={6: 50.0, 7: 50.0, 8: 50.0, 9: 50.0, 10: 50.0})
    with open(rec.core.log_path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    validator = jsonschema.Draft202012Validator(event_schema())
    for r in records:
        assert not list(validator.iter_errors(r)), r
    (halt,) = [r for r in records if r["type"] == "halt"]
    findings = {r["id"]: r for r in records if r["type"] == "finding"}
    assert halt["finding_ids"] and all(findings[i]["step"] == halt["step"] for i in halt["finding_ids"])
    with open(rec.core.diagnosis_path, encoding="utf-8") as fh:
        diag = json.load(fh)
    assert diag["advice"]["settings"]["lr_factor"] < 1
    assert any("halted" in line for line in diag["advice"]["lines"])
