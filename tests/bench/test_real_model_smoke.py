"""bench/real_model.py on a tiny model: its config is examples/smollm2_chain_sum.yaml, the example's
split is the one --write-data writes and is disjoint, and one step runs with grpolab eval's
evaluation. (SmolLM2 itself is not loaded.)"""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from grpolab import config as C
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

_PATH = Path(__file__).resolve().parents[2] / "bench" / "real_model.py"
_spec = importlib.util.spec_from_file_location("bench_real_model", _PATH)
rm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rm)

SMALL = ["--steps", "1", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "4",
         "--eval-samples", "1", "--eval-every", "0", "--dtype", "float32", "--lr", "1e-3", "--microbatch", "2"]


def _tiny():
    tok = build_char_tokenizer("S:", model_max_length=128)  # chain_sum questions start "State ...:"
    return build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, max_positions=128, seed=0), tok


def test_config_is_the_example_with_the_flags():
    cfg = rm.bench_config(rm.parse_args(["--out", "x"]))
    example = C.load(str(rm.EXAMPLE))
    for section in ("model", "rollout", "loss"):
        assert getattr(cfg, section) == getattr(example, section)
    assert cfg.train.steps == example.train.steps and cfg.train.lr == example.train.lr
    assert cfg.loss.kl_coef == 0 and cfg.loss.filter_zero_std_groups
    assert cfg.sequences_per_step == cfg.minibatch_sequences == 64 and not cfg.needs_old_logp_pass
    assert cfg.data.system_prompt == example.data.system_prompt and cfg.data.eval_prompts == 128
    assert [s.name for s in cfg.rewards] == ["reasoning_gym"]
    small = rm.bench_config(rm.parse_args(SMALL + ["--out", "x"]))
    assert (small.train.steps, small.rollout.group_size, small.model.dtype) == (1, 2, "float32")


def test_same_seeds_rejected():
    with pytest.raises(SystemExit):
        rm.parse_args(["--seed", "3", "--eval-seed", "3"])


def test_example_split_is_what_write_data_writes_and_disjoint(tmp_path):
    rm.write_data(rm.parse_args([]), tmp_path)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_text() == (rm.DATA / name).read_text(), name
    cfg = rm.bench_config(rm.parse_args(["--out", "x"]))
    train, held = rm.load_splits(cfg, None)
    q = lambda items: [it.meta["rg_entry"]["question"] for it in items]
    assert len(held) == len(set(q(held))) == 128
    assert len(train) == len(set(q(train))) > 0
    assert not set(q(held)) & set(q(train))
    assert len(held) + len(train) <= 200  # the task has 200 distinct questions


def test_one_step_end_to_end(tmp_path, capsys):
    model, tok = _tiny()
    args = rm.parse_args(SMALL + ["--out", str(tmp_path / "run")])
    summary = rm.run(args, policy=model, tokenizer=tok)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["mode"] == "full fine-tune" and len(saved["curve"]) == 1
    for when in ("before", "after"):
        assert saved[when]["prompts"] == 4 and saved[when]["sampled"]["samples"] == 1
        assert 0.0 <= saved[when]["greedy"]["reward"] <= 1.0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    # a random tiny model never solves chain_sum, so every group is zero-variance and dropped from the
    # loss: the reported lengths must still be the generated ones (≥ 1: the EOS or max_new_tokens)
    assert saved["curve"][0]["len"] >= 1
    groups = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert groups and all(c["length"] >= 1 for g in groups for c in g["completions"])
    assert summary["phase_totals_s"]["step"] > 0
    assert "held-out reward" in capsys.readouterr().out
