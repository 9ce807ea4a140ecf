"""A table of bad inputs: each must fail with a message that names the culprit (the field, the file
and line, the reward function and row, the checkpoint file), and up front: before any generation.

Config, datasets, models, reward functions and checkpoints. Reward functions are probed at
start-up (one empty completion per prompt), so a crash, a wrong count, NaN/inf or a hang is
reported before the first rollout; `train.on_reward_error` decides what errors during training do.
"""

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from grpolab import cli, config as C
from grpolab.rewards.base import register_reward, reward_names
from grpolab.rollout.hf import HFEngine
from grpolab.rundir import checkpoint as ck
from grpolab.grpo import loop as grpo
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "train.steps=1", "train.minibatch_size=4", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false"]
_HANG = threading.Event()  # never set: a hung reward waits on it (its daemon thread is left behind)


def _register(name, body):
    if name not in reward_names():
        register_reward(name)(lambda: _Fn(name, body))


class _Fn:
    def __init__(self, name, body):
        self.name, self.body = name, body

    def __call__(self, prompts, completions, metadata):
        return self.body(prompts, completions, metadata)


_register("t_raise", lambda p, c, m: [1 / 0 for _ in c])
_register("t_count", lambda p, c, m: [1.0])
_register("t_nan", lambda p, c, m: [0.0, float("nan")] + [0.0] * (len(c) - 2))
_register("t_inf", lambda p, c, m: [float("inf")] * len(c))
_register("t_str", lambda p, c, m: ["high"] * len(c))
_register("t_none", lambda p, c, m: None)
_register("t_hang", lambda p, c, m: _HANG.wait(60) or [0.0] * len(c))
_register("t_late", lambda p, c, m: [0.0] * len(c) if all(x == "" for x in c) else [float("nan")] * len(c))
_register("t_abstain", lambda p, c, m: [None] * len(c))


@pytest.fixture(autouse=True)
def no_generation(monkeypatch):
    """Every check in the table must fire before the first rollout."""

    def fail(*a, **k):
        raise AssertionError("generation started before the bad input was reported")

    monkeypatch.setattr(HFEngine, "generate", fail)


def _setup(*ov):
    return build_setup(C.from_preset("grpo", TINY + list(ov)))


def _yaml(tmp, text):
    p = tmp / "cfg.yaml"
    p.write_text(text)
    return str(p)


def _jsonl(tmp, *lines):
    p = tmp / "data.jsonl"
    p.write_text("".join(x + "\n" for x in lines))
    return f"data.source=jsonl:{p}"


def _model_dir(tmp, model_type="distilbert", weights="safetensors"):
    from transformers import AutoConfig

    d = tmp / "model"
    AutoConfig.for_model(model_type).save_pretrained(d)
    if weights == "safetensors":
        save_file({"x": torch.zeros(1)}, d / "model.safetensors")
    elif weights == "pickle":
        torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    return f"model.name_or_path={d}"


def _checkpoint(tmp, *ov):
    s = _setup(*ov)
    return ck.save_checkpoint(s, tmp / "run" / "checkpoints", step=1, keep=1)


def _resume(tmp, path):
    """What `grpolab train ... run.resume=PATH` does before the loop."""
    s = _setup()
    return ck.load_checkpoint(s, ck.resolve_resume(str(path), tmp))


def _damaged(tmp):
    path = _checkpoint(tmp)
    (path / "rng.pt").write_bytes(b"garbage")
    return path


def _cli(tmp, *argv):
    code = cli.main(list(argv))
    raise SystemExit(code)


CASES = [
    # ------------------------------------------------------------------ config
    ("yaml unknown field", lambda t: C.load(_yaml(t, "preset: grpo\ntrain:\n  stpes: 3\n")),
     ["cfg.yaml:3", "unknown field 'train.stpes'", "Did you mean 'train.steps'"]),
    ("yaml wrong type", lambda t: C.load(_yaml(t, "rollout:\n  group_size: eight\n")),
     ["cfg.yaml:2", "rollout.group_size", "expected an integer"]),
    ("yaml syntax", lambda t: C.load(_yaml(t, "train:\n  steps: [1,\n")), ["cfg.yaml:", "not valid YAML"]),
    ("yaml not a mapping", lambda t: C.load(_yaml(t, "- a\n- b\n")), ["cfg.yaml:1", "must be a mapping"]),
    ("yaml reward spec field", lambda t: C.load(_yaml(t, "rewards:\n  - name: exact_match\n    weigth: 2\n")),
     ["cfg.yaml:3", "rewards[0].weigth"]),
    ("config file missing", lambda t: C.load(str(t / "nope.yaml")), ["nope.yaml", "cannot be read"]),
    ("override unknown field", lambda t: C.from_preset("grpo", ["train.lrr=1"]), ["train.lrr", "train.lr"]),
    ("override wrong type", lambda t: C.from_preset("grpo", ["train.steps=abc"]), ["train.steps", "integer"]),
    ("unknown preset", lambda t: C.from_preset("grpoo"), ["grpoo", "unknown preset"]),
    ("bad choice", lambda t: C.from_preset("grpo", ["loss.loss_agg=tokenmean"]),
     ["loss.loss_agg='tokenmean'", "Did you mean 'token-mean'"]),
    ("minibatch does not divide", lambda t: C.from_preset("grpo", ["rollout.prompts_per_step=3", "rollout.group_size=4",
                                                                  "train.minibatch_size=5", "train.microbatch_size=5"]),
     ["train.minibatch_size=5", "12 sequences"]),
    ("microbatch does not divide", lambda t: C.from_preset("grpo", ["train.minibatch_size=64", "train.microbatch_size=48"]),
     ["train.microbatch_size", "48"]),
    ("group of one", lambda t: C.from_preset("grpo", ["rollout.group_size=1", "train.minibatch_size=16",
                                                      "train.microbatch_size=16"]), ["rollout.group_size=1"]),
    ("negative lr", lambda t: C.from_preset("grpo", ["train.lr=-1"]), ["train.lr=-1"]),
    ("keep no checkpoints", lambda t: C.from_preset("grpo", ["run.keep_checkpoints=0"]), ["run.keep_checkpoints=0"]),
    ("negative reward timeout", lambda t: C.from_preset("grpo", ["train.reward_timeout_s=-1"]),
     ["train.reward_timeout_s=-1"]),
    ("completion fills the context", lambda t: _setup("rollout.max_new_tokens=64"),
     ["rollout.max_new_tokens=64", "context of 64 tokens"]),
    ("held-out side too small", lambda t: _cli(t, "demo", "--out", str(t / "demo"), "data.eval_prompts=1000"),
     ["grpolab: config error:", "data.eval_prompts=1000", "only"]),
    ("resume without out_dir", lambda t: _cli(t, "train", "grpo", *TINY, "--resume"), ["--resume", "run.out_dir"]),
    # ------------------------------------------------------------------ datasets
    ("dataset missing", lambda t: _setup(f"data.source=jsonl:{t}/missing.jsonl"), ["missing.jsonl", "not found"]),
    ("dataset bad json line", lambda t: _setup(_jsonl(t, '{"prompt": "1+1="}', '{"prompt": "2+2=",}')),
     ["data.jsonl:2", "not valid JSON"]),
    ("dataset missing field", lambda t: _setup(_jsonl(t, '{"question": "1+1="}')),
     ["data.jsonl:1", "'prompt'", "question"]),
    ("dataset empty prompt", lambda t: _setup(_jsonl(t, '{"prompt": "1+1="}', "", '{"prompt": "  "}')),
     ["data.jsonl:3", "'prompt' is empty"]),
    ("dataset row not an object", lambda t: _setup(_jsonl(t, "[1, 2]")), ["data.jsonl:1", "expected a JSON object"]),
    ("dataset empty file", lambda t: _setup(_jsonl(t)), ["data.jsonl", "no prompts"]),
    ("prompt longer than the context", lambda t: _setup(_jsonl(t, '{"prompt": "1+1="}', json.dumps({"prompt": "1" * 61}))),
     ["data.jsonl:2", "61 tokens long", "context of 64 tokens minus rollout.max_new_tokens=4"]),
    ("prompt over max_prompt_tokens", lambda t: _setup(_jsonl(t, '{"prompt": "12345+1="}'), "data.max_prompt_tokens=5"),
     ["data.jsonl:1", "8 tokens long", "data.max_prompt_tokens=5"]),
    ("unknown data source", lambda t: _setup("data.source=csv:x.csv"), ["data.source='csv:x.csv'"]),
    ("dataset error via the CLI", lambda t: _cli(t, "train", "grpo", *TINY, f"data.source=jsonl:{t}/gone.jsonl",
                                                 f"run.out_dir={t}/run"), ["grpolab: error:", "gone.jsonl"]),
    # ------------------------------------------------------------------ models
    ("model path missing", lambda t: _setup(f"model.name_or_path={t}/no-model"), ["no-model", "not found"]),
    ("model wrong architecture", lambda t: _setup(_model_dir(t)), ["distilbert", "not a decoder-only causal LM"]),
    ("model pickle weights only", lambda t: _setup(_model_dir(t, "llama", weights="pickle")),
     ["no *.safetensors", "never loaded"]),
    ("model folder without config", lambda t: (t / "m").mkdir() or _setup(f"model.name_or_path={t}/m"),
     ["has no config.json"]),
    # ------------------------------------------------------------------ reward functions
    ("reward unknown", lambda t: _setup("rewards=[exact_macth]"), ["'exact_macth'", "Did you mean 'exact_match'"]),
    ("reward bad kwargs", lambda t: _setup("rewards=[{name: refusal, kwargs: {nope: 1}}]"), ["'refusal'", "nope"]),
    ("reward raises", lambda t: _setup("rewards=[t_raise]"), ["'t_raise'", "ZeroDivisionError", "start-up"]),
    ("reward wrong count", lambda t: _setup("rewards=[t_count]"), ["'t_count'", "returned 1 scores for 2"]),
    ("reward NaN", lambda t: _setup("rewards=[t_nan]"), ["'t_nan'", "row 1", "nan"]),
    ("reward inf", lambda t: _setup("rewards=[t_inf]"), ["'t_inf'", "row 0", "inf"]),
    ("reward not a number", lambda t: _setup("rewards=[t_str]"), ["'t_str'", "row 0", "'high'"]),
    ("reward returns None", lambda t: _setup("rewards=[t_none]"), ["'t_none'", "returned None scores"]),
    ("reward hangs", lambda t: _setup("rewards=[t_hang]", "train.reward_timeout_s=0.3"),
     ["'t_hang'", "train.reward_timeout_s=0.3", "cannot be killed"]),
    # ------------------------------------------------------------------ checkpoints
    ("resume path missing", lambda t: ck.resolve_resume(str(t / "gone"), t), ["run.resume=", "gone"]),
    ("resume empty folder", lambda t: (t / "run" / "checkpoints").mkdir(parents=True) or ck.resolve_resume(str(t / "run"), t),
     ["no complete checkpoint", "run"]),
    ("resume incomplete", lambda t: (t / "step-4").mkdir() or ck.resolve_resume(str(t / "step-4"), t),
     ["step-4 is incomplete", "COMPLETE"]),
    ("resume damaged file", lambda t: _resume(t, _damaged(t)), ["rng.pt", "damaged"]),
    ("resume another model", lambda t: _resume(t, _checkpoint(t, "model.hidden_size=64")),
     ["model.safetensors", "does not fit this model"]),
    ("fresh run over checkpoints", lambda t: _checkpoint(t) and _cli(t, "train", "grpo", *TINY, f"run.out_dir={t}/run"),
     ["already holds an unfinished", "step-1", "--resume"]),
]


@pytest.mark.parametrize("action,expected", [pytest.param(a, e, id=i) for i, a, e in CASES])
def test_bad_input_is_named(action, expected, tmp_path, capsys):
    with pytest.raises((ValueError, RuntimeError, FileNotFoundError, SystemExit)) as info:
        action(tmp_path)
    if info.type is SystemExit:  # through the CLI: exit code 2 and one paragraph, no traceback
        assert info.value.code == 2
        msg = capsys.readouterr().err
        assert "Traceback" not in msg and msg.count("\n") == 1, msg
    else:
        msg = str(info.value)
    for part in expected:
        assert part in msg, f"{part!r} not in: {msg}"


def test_the_table_is_large_enough():
    assert len(CASES) >= 25


# ---------------------------------------------------------------------- errors during training
@pytest.fixture
def generation(monkeypatch):
    monkeypatch.undo()  # these runs do generate


@pytest.mark.parametrize("policy,errors,value", [("zero", 1, 0.0), ("skip_group", 1, None)])
def test_on_reward_error_policy_counts_errors_and_continues(generation, tmp_path, policy, errors, value):
    s = _setup("rewards=[t_late, refusal]", f"train.on_reward_error={policy}")
    assert train_in_run_dir(s, tmp_path) == 0
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["reward_errors"] == errors
    assert row["reward/t_late/mean"] == value  # zero: scored 0; skip_group: abstained (NaN -> null)


def test_a_reward_that_fails_mid_run_names_the_function_and_row(generation):
    s = _setup("rewards=[t_late]")  # passes the start-up probe (empty completions), fails on real ones
    with pytest.raises(RuntimeError, match=r"reward 't_late' returned nan for row 0"):
        grpo.train(s)


def test_abstaining_is_not_an_error(generation, tmp_path):
    s = _setup("rewards=[t_abstain, refusal]")
    assert train_in_run_dir(s, tmp_path) == 0
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["reward_errors"] == 0 and row["reward/t_abstain/mean"] is None


def test_with_a_lenient_policy_the_start_up_probe_only_warns(generation, tmp_path, capsys):
    s = _setup("rewards=[t_raise, refusal]", "train.on_reward_error=zero")
    assert "grpolab: warning: reward 't_raise' raised ZeroDivisionError" in capsys.readouterr().err
    assert train_in_run_dir(s, tmp_path) == 0
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward_errors"] == 1
