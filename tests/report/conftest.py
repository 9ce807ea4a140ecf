"""A small synthetic run directory (the files the GRPO loop writes), shared by the report tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab.report.schema import METRICS

REWARD_NAMES = ("accuracy_rm", "refusal_rm")


def metrics_row(step: int, reward_names=REWARD_NAMES, offset: float = 0.0) -> dict:
    """A complete metrics row: every schema key, deterministic values varying with step."""
    row = {m.key: (0 if m.kind == "int" else 0.1 * step + offset) for m in METRICS}
    row["step"] = step
    row["reward/mean"] = 0.2 + 0.1 * step + offset
    row["reward/std"] = 0.05
    row["kl"] = 0.001 * step
    row["time/step_s"] = 1.5
    for i, name in enumerate(reward_names):
        row[f"reward/{name}/mean"] = 0.1 * (i + 1) + 0.05 * step
        row[f"reward/{name}/std"] = 0.02
    return row


def make_run(root: Path, name: str = "run-a", steps: int = 5, offset: float = 0.0,
             samples: bool = True, eval_json: bool = True) -> Path:
    """runs/<name>/ with `steps` metrics rows, samples for 2 steps (2 groups x 4), eval.json."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("algo: grpo\ngroup_size: 4\n", encoding="utf-8")
    with (run / "metrics.jsonl").open("w") as f:
        for s in range(steps):
            f.write(json.dumps(metrics_row(s, offset=offset)) + "\n")
    if samples:
        with (run / "samples.jsonl").open("w") as f:
            for step in (0, steps - 1):
                for g in range(2):
                    comps = []
                    for i in range(4):
                        r = [0.9, 0.1, 0.5, 0.3][i] + 0.01 * g
                        comps.append({
                            "text": f"<b>answer</b> {step}-{g}-{i} & 'quote'",
                            "rewards": {"accuracy_rm": r, "refusal_rm": None if i == 2 else 0.5},
                            "reward": r, "advantage": [1.4, -1.1, 0.3, -0.6][i],
                            "length": 10 + i, "truncated": i == 3})
                    f.write(json.dumps({"step": step, "prompt": f"What is {g} + {step}? <script>",
                                        "meta": {"gold": str(g + step)},
                                        "completions": comps}) + "\n")
    if eval_json:
        (run / "eval.json").write_text(json.dumps({
            "before": {"accuracy": 0.25, "refusal_recall": 0.1, "false_refusal": 0.05},
            "after": {"accuracy": 0.5, "refusal_recall": 0.6, "false_refusal": 0.04},
            "rewards": [{"name": "accuracy_rm", "weight": 1.0},
                        {"name": "refusal_rm", "weight": 0.5}],
            "reward_models": {"accuracy_rm": 0.91, "refusal_rm": 0.87}}), encoding="utf-8")
    return run


@pytest.fixture
def fake_run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "runs")


@pytest.fixture
def make_row():
    """metrics_row(step, reward_names=REWARD_NAMES, offset=0.0) -> a complete metrics row."""
    return metrics_row


@pytest.fixture
def reward_names() -> list[str]:
    return list(REWARD_NAMES)


@pytest.fixture
def run_factory(tmp_path: Path):
    """make(name, **kwargs) -> a synthetic run dir under tmp_path/runs (see make_run)."""
    return lambda name="run-a", **kw: make_run(tmp_path / "runs", name, **kw)


@pytest.fixture(scope="session")
def fake_report(tmp_path_factory) -> Path:
    """report.html of one synthetic run, written once per session (tests must not modify it)."""
    from grpolab.report.html import write_report

    return write_report(make_run(tmp_path_factory.mktemp("report") / "runs"))
