"""Callbacks (grpolab.api.callbacks): each is called with what it names; one returning True stops the run the
way SIGTERM does (the step finished, a checkpoint saved, no final/), and `--resume` (or resume=True)
continues it to the same metrics and weights as a run never stopped. examples/early_stop.py stops."""

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

import grpolab
from grpolab import cli

ROOT = Path(__file__).resolve().parents[2]
TIMING_KEYS = ("time/", "tokens_per_s/", "mfu")
TINY = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "rollout.prompts_per_step": 2,
        "rollout.group_size": 4, "rollout.max_new_tokens": 4, "train.steps": 4, "train.minibatch_size": 4,
        "train.microbatch_size": 4, "train.lr": 1e-2, "loss.entropy_coef": 0.01, "run.progress": False,
        "run.tensorboard": False, "data.eval_prompts": 8, "run.eval_every": 2}


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


class Recorder(grpolab.Callback):
    def __init__(self, stop_after: int | None = None):
        self.stop_after, self.seen = stop_after, []

    def on_rollout(self, step, record):
        self.seen.append(("rollout", step, len(record.texts)))

    def on_evaluate(self, step, metrics):
        self.seen.append(("evaluate", step, sorted(metrics)))

    def on_step_end(self, step, metrics):
        self.seen.append(("step_end", step, metrics["step"]))
        return self.stop_after is not None and step + 1 >= self.stop_after

    def on_save(self, step, checkpoint):
        self.seen.append(("save", step, Path(checkpoint).name))


def test_a_callback_stops_the_run_saved_and_resume_matches_an_unstopped_run(tmp_path):
    full = grpolab.train("grpo", {**TINY, "run.out_dir": str(tmp_path / "full")}, callbacks=[Recorder()])
    assert full.final_model is not None and not full.stopped_by and len(full.metrics) == 4

    rec = Recorder(stop_after=2)
    stopped = grpolab.train("grpo", {**TINY, "run.out_dir": str(tmp_path / "run")}, callbacks=[rec])
    assert stopped.exit_code == 0 and stopped.stopped_by == "Recorder.on_step_end"
    assert len(stopped.metrics) == 2 and stopped.final_model is None and not (tmp_path / "run" / "final").exists()
    assert stopped.checkpoint == tmp_path / "run" / "checkpoints" / "step-2"
    kinds = [(k, s) for k, s, _ in rec.seen]
    assert kinds == [("rollout", 0), ("step_end", 0), ("rollout", 1), ("evaluate", 1), ("step_end", 1), ("save", 2)]
    assert rec.seen[0][2] == 8  # P x G completions
    assert "accuracy" in rec.seen[3][2]
    assert "eval/accuracy" in stopped.metrics[1] and "eval/accuracy" not in stopped.metrics[0]

    # the command line's --resume continues it from step-2, with the run's own config.yaml
    assert cli.main(["train", str(tmp_path / "run" / "config.yaml"), "--resume"]) == 0
    assert _rows(tmp_path / "run") == _rows(tmp_path / "full")
    a = load_file(tmp_path / "run" / "final" / "model.safetensors")
    b = load_file(tmp_path / "full" / "final" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k])


def test_the_early_stopping_example_stops_and_resumes(tmp_path):
    spec = importlib.util.spec_from_file_location("early_stop", ROOT / "examples" / "early_stop.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    small = {k: v for k, v in TINY.items() if k != "run.eval_every"}
    out = str(tmp_path / "run")
    result = example.main(out, **{**small, "train.steps": 8, "run.eval_every": 1})
    # an untrained tiny model scores 0 every time: no improvement after the first evaluation, patience 2
    assert result.stopped_by == "EarlyStop.on_evaluate" and len(result.metrics) == 3
    assert result.checkpoint.name == "step-3" and result.final_model is None
    again = grpolab.train(result.run_dir / "config.yaml", {"train.steps": 4}, resume=True)
    assert again.exit_code == 0 and len(again.metrics) == 4 and again.final_model is not None


def test_eval_every_is_validated():
    import pytest

    from grpolab.errors import ConfigError

    with pytest.raises(ConfigError, match="run.eval_every=-1"):
        grpolab.make_config("grpo", {"run.eval_every": -1})
    with pytest.raises(ConfigError, match="fsdp2"):
        grpolab.make_config("grpo", {"run.eval_every": 5, "train.parallel": "fsdp2"})
