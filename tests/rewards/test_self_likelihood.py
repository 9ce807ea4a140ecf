"""The self_likelihood reward (sharpening): log π0(completion | prompt) of a frozen tiny model, checked
against token log-probs summed by hand from one plain forward."""

from __future__ import annotations

import json

import pytest
import torch

from grpolab import cli, config as C
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rewards.registry import build_reward
from grpolab.rewards.self_likelihood import SelfLikelihood, completion_eos_mask
from grpolab.rewards.registry import build_rewards
from grpolab.models.policy import load_policy
from grpolab.sft.sft import train_sft

PROMPTS = ["12+7=", "3+4=", "99-98=", "5*5="]
COMPLETIONS = ["91", "cannot", "", "52x"]


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer()
    return build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).eval(), tok


def hand_logprobs(model, tok, prompt: str, completion: str, eos: bool) -> torch.Tensor:
    """Token log-probs of completion (+ EOS) after prompt: one unpadded forward, log_softmax, gather."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
    ids = torch.tensor([p + c])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)  # [T, V]
    return torch.stack([logp[len(p) - 1 + i, t] for i, t in enumerate(c)])


def test_equals_hand_summed_and_mean_token_logprobs(tiny):
    model, tok = tiny
    metas = [{}, {"truncated": False}, {}, {"truncated": True}]
    got_sum = SelfLikelihood(model=model, tokenizer=tok)(PROMPTS, COMPLETIONS, metas)
    got_mean = SelfLikelihood(model=model, tokenizer=tok, length_normalized=True)(PROMPTS, COMPLETIONS, metas)
    for i, (p, c, m) in enumerate(zip(PROMPTS, COMPLETIONS, metas)):
        lp = hand_logprobs(model, tok, p, c, eos=not m.get("truncated", False))
        assert len(lp) == len(tok(c, add_special_tokens=False)["input_ids"]) + (0 if m.get("truncated") else 1)
        torch.testing.assert_close(torch.tensor(got_sum[i]), lp.sum())
        torch.testing.assert_close(torch.tensor(got_mean[i]), lp.mean())
    assert got_sum[2] == pytest.approx(got_mean[2])  # "" finished: the EOS alone, one token


def test_truncated_rows_leave_out_the_eos_term(tiny):
    model, tok = tiny
    fn = SelfLikelihood(model=model, tokenizer=tok)
    done, cut = fn(["12+7="] * 2, ["91"] * 2, [{"truncated": False}, {"truncated": True}])
    eos = hand_logprobs(model, tok, "12+7=", "91", eos=True)[-1]
    torch.testing.assert_close(torch.tensor(done - cut), eos)


def test_eos_mask_drops_only_the_last_counted_token_of_unfinished_rows():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    got = completion_eos_mask(mask, torch.tensor([True, False, False]))
    assert got.tolist() == [[True, True, True, False], [True, False, False, False], [False] * 4]


def test_invariant_to_batch_size(tiny):
    model, tok = tiny
    prompts, comps = PROMPTS * 3, COMPLETIONS * 3
    metas = [{"truncated": i % 5 == 0} for i in range(len(prompts))]
    ref = torch.tensor(SelfLikelihood(model=model, tokenizer=tok, batch_size=64)(prompts, comps, metas))
    for bs in (1, 3, 5):
        torch.testing.assert_close(torch.tensor(SelfLikelihood(model=model, tokenizer=tok, batch_size=bs)(
            prompts, comps, metas)), ref)


def test_a_completion_the_model_learned_scores_higher():
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=1)
    fn0 = SelfLikelihood(model=model, tokenizer=tok)  # π0: a frozen copy, taken now
    train_sft(model, tok, [("1+1=", "2")], steps=30, batch_size=4, microbatch_size=4, lr=3e-3)
    fn1 = SelfLikelihood(model=model, tokenizer=tok)
    learned, other = fn1(["1+1="] * 2, ["2", "7"], [{}, {}])
    assert learned > other + 1.0
    assert fn0(["1+1="], ["2"], [{}])[0] < learned - 1.0  # the earlier copy did not train along


def test_frozen_no_grad_and_scores_are_plain_floats(tiny):
    model, tok = tiny
    fn = SelfLikelihood(model=model, tokenizer=tok)
    assert fn.model is not model and not any(p.requires_grad for p in fn.model.parameters())
    assert not fn.model.training and fn.verifier is False
    out = fn(["1+1="], ["2"], [{}])
    assert isinstance(out[0], float) and out[0] < 0
    assert fn([], [], []) == []


def test_built_by_name_from_a_folder_or_a_run_directory(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path / "run" / "final")
    tok.save_pretrained(tmp_path / "run" / "final")
    direct = SelfLikelihood(model=model, tokenizer=tok)(PROMPTS, COMPLETIONS, [{}] * 4)
    for path in (tmp_path / "run" / "final", tmp_path / "run"):
        fn = build_reward("self_likelihood", path=str(path), length_normalized=False, batch_size=2)
        assert fn.name == "self_likelihood" and fn.verifier is False and fn.path == str(tmp_path / "run" / "final")
        torch.testing.assert_close(torch.tensor(fn(PROMPTS, COMPLETIONS, [{}] * 4)), torch.tensor(direct))


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="kwargs.path"):
        SelfLikelihood()
    with pytest.raises(ValueError, match=r"kwargs.path='.*nowhere'"):
        SelfLikelihood(path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="batch_size"):
        SelfLikelihood(path="x", batch_size=0)
    with pytest.raises(ValueError, match="length_normalized"):
        SelfLikelihood(path="x", length_normalized="yes")


def test_config_without_path_scores_under_the_starting_model():
    cfg = C.from_preset("grpo", ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
                                 "rewards=[self_likelihood:1.0]", "model.lora_rank=4"])
    (fn, weight), = build_rewards(cfg)
    policy, tok = load_policy(cfg.replace(**{"model.lora_rank": 0}))
    expected = SelfLikelihood(model=policy, tokenizer=tok)(PROMPTS, COMPLETIONS, [{}] * 4)
    assert weight == 1.0 and fn.name == "self_likelihood"
    assert fn(PROMPTS, COMPLETIONS, [{}] * 4) == expected


def test_grpo_step_with_the_self_likelihood_reward(tmp_path):
    tiny = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=1", "train.minibatch_size=4",
            "train.microbatch_size=4", "run.progress=false", "run.tensorboard=false"]
    assert cli.main(["train", "grpo", *tiny, "rewards=[self_likelihood:1.0]", f"run.out_dir={tmp_path}"]) == 0
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/self_likelihood/mean"] < 0  # a sum of log-probs
