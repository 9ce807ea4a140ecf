"""`grpolab demo --quick` end to end: a real gain on held-out prompts, and a complete run directory."""

import json

import pytest

from grpolab.demo import demo_config, run_demo
from grpolab.report.metrics import read_metrics
from grpolab.report.schema import METRICS, validate_metrics_row, validate_sample_row


@pytest.mark.slow
def test_demo_quick_gains_and_writes_the_run_directory(tmp_path, capsys):
    cfg = demo_config(quick=True, seed=0, overrides=["run.progress=false"])
    payload = run_demo(cfg, run_dir=tmp_path, report=True)
    before, after = payload["before"], payload["after"]
    # A real gain, not noise: 256 held-out prompts (192 answerable, 64 unanswerable).
    assert after["accuracy"] - before["accuracy"] >= 0.10, (before, after)
    # Refusal: the quick run's 120 steps do not move it reliably. Its gain depends on the CPU's float
    # rounding (AVX-512 hosts measured >= +0.15; an AVX2-only host +0.088: missing operands 0.45 ->
    # 0.57, division by zero 0 -> 0); the full demo runs 400 steps. Here:
    # the accuracy gain did not cost refusals, and it did not come from refusing answerable prompts.
    assert after["refusal_recall"] >= before["refusal_recall"], (before, after)
    assert after["false_refusal"] <= 0.10
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "eval.json", "report.html"):
        assert (tmp_path / name).exists(), name
    assert (tmp_path / "pi0" / "model.safetensors").exists() and (tmp_path / "final" / "model.safetensors").exists()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(cfg.train.steps))
    names = [s.display_name for s in cfg.rewards]
    for row in rows:
        validate_metrics_row(row, reward_names=names)
        missing = sorted(m.key for m in METRICS if m.required and m.key not in row)
        assert not missing, missing
    assert "accuracy" in rows[0]  # exact_match is a verifier
    with open(tmp_path / "samples.jsonl") as f:
        groups = [json.loads(line) for line in f]
    assert len(groups) == cfg.train.steps * cfg.rollout.prompts_per_step
    for g in groups[:20]:
        validate_sample_row(g)
        assert len(g["completions"]) == cfg.rollout.group_size
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert set(ev["before"]) >= {"accuracy", "refusal_recall", "false_refusal"}
    assert ev["rewards"] == [{"name": s.display_name, "weight": s.weight} for s in cfg.rewards]
    out = capsys.readouterr().out
    assert "held-out metric" in out and "report:" in out
