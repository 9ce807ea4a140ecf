import json
import random
from pathlib import Path

import pytest
import torch

from grpolab.data.arith import ArithTask
from grpolab.data.preferences import PrefPair, refusal_pairs
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.app.demo_reward_models import build_demo_reward_models
from grpolab.reward_models.model import load_train_pairs
from grpolab.reward_models.model import (
    RM_INFO_FILE,
    build_reward_model,
    encode_texts,
    load_reward_model,
    pad_right,
    save_reward_model,
    score_ids,
    score_positions,
    score_texts,
)
from grpolab.reward_models.training import accumulate_pair_gradients, evaluate_pairs, train_reward_model
from grpolab.app.demo_reward_models import torch_threads

TINY = dict(hidden_size=32, num_layers=2, num_heads=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Models this small run fastest on one thread; two threads on a busy 2-core box are 5-20x slower.
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def rm(tok, seed=0, dtype=torch.float32):
    return build_reward_model("builtin:tiny", tok, seed=seed, **TINY).to(dtype)


PAIRS = [
    PrefPair("12+7=", "19", "20"), PrefPair("3*4=", "12", "cannot"), PrefPair("5/0=", "cannot", "5"),
    PrefPair("99-9=", "90", ""), PrefPair("+4=", "cannot", "cann"), PrefPair("1+1=", "2", "1234567"),
    PrefPair("8/2=", "4", "44"), PrefPair("6*=", "cannot", "0"),
]


def test_right_padding_scores_like_the_unpadded_row(tok):
    model = rm(tok).eval()
    seqs = encode_texts(tok, ["1+1=", "123*45=", "5/0="], ["2", "5535", "cannot"], append_eos=True)
    assert all(s[-1] == tok.eos_token_id for s in seqs)
    with torch.no_grad():
        together = score_ids(model, seqs)
        alone = torch.cat([score_ids(model, [s]) for s in seqs])
    torch.testing.assert_close(together, alone)


def test_the_scored_token_is_the_last_real_token(tok):
    model = rm(tok).eval()
    seqs = encode_texts(tok, ["1+1=", "10*10="], ["2", "100"], append_eos=True)
    with torch.no_grad():
        scores = score_ids(model, seqs)
        for i, s in enumerate(seqs):
            hidden = model.model(input_ids=torch.tensor([s])).last_hidden_state[0, -1]
            torch.testing.assert_close(scores[i], model.score(hidden)[0])
    assert model.config.pad_token_id == tok.pad_token_id and model.config.num_labels == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("aux", [{}, {"lm_coef": 0.5, "divergence_coef": 2.0}], ids=["plain", "aux-terms"])
def test_gradient_does_not_depend_on_the_microbatch_size(tok, dtype, aux):
    grads = {}
    for micro in (1, 8, 4):
        model = rm(tok, dtype=dtype).train()
        model.zero_grad(set_to_none=True)
        loss = accumulate_pair_gradients(model, tok, PAIRS, microbatch_size=micro, **aux)
        grads[micro] = (loss, [p.grad.clone() for p in model.parameters()])
    for micro in (1, 4):
        assert grads[micro][0] == pytest.approx(grads[8][0], rel=1e-6)
        for a, b in zip(grads[micro][1], grads[8][1]):
            torch.testing.assert_close(a, b)
    assert any(g.abs().sum() > 0 for g in grads[8][1])


def test_loss_is_the_mean_pairwise_logsigmoid(tok):
    model = rm(tok).train()
    loss = accumulate_pair_gradients(model, tok, PAIRS[:3], microbatch_size=2)
    prompts = [p.prompt for p in PAIRS[:3]]
    c = score_texts(model, tok, prompts, [p.chosen for p in PAIRS[:3]])
    r = score_texts(model, tok, prompts, [p.rejected for p in PAIRS[:3]])
    assert loss == pytest.approx(float(torch.nn.functional.softplus(r - c).mean()), rel=1e-5)


def test_score_positions_ends_in_the_models_own_score(tok):
    model = rm(tok).eval()
    seqs = encode_texts(tok, ["1+1=", "10*10="], ["2", "100"], append_eos=True)
    ids, mask = pad_right(seqs, model.config.pad_token_id)
    with torch.no_grad():
        per_pos, hidden = score_positions(model, ids, mask)
        torch.testing.assert_close(per_pos[torch.arange(2), mask.sum(1) - 1], score_ids(model, seqs))
    assert per_pos.shape == ids.shape and hidden.shape == (*ids.shape, TINY["hidden_size"])


def test_aux_terms_by_hand(tok):
    """The loss with both auxiliary terms: pairwise + c_div * pairwise at the first differing token
    + c_lm * mean NLL of the chosen completion tokens (logits through the input embeddings)."""
    model = rm(tok, dtype=torch.float64).train()
    pair = PrefPair("12+7=", "19", "13")  # part at the 2nd completion character
    loss = accumulate_pair_gradients(model, tok, [pair], microbatch_size=1, lm_coef=0.5, divergence_coef=2.0)
    c_ids, r_ids = encode_texts(tok, [pair.prompt] * 2, [pair.chosen, pair.rejected], append_eos=True)
    n_prompt = len(tok(pair.prompt)["input_ids"])
    with torch.no_grad():
        c_h = model.model(input_ids=torch.tensor([c_ids])).last_hidden_state[0]
        r_h = model.model(input_ids=torch.tensor([r_ids])).last_hidden_state[0]
        c_s, r_s = model.score(c_h)[:, 0], model.score(r_h)[:, 0]
        t = n_prompt + 1  # the first position where "19" and "13" differ
        logp = torch.log_softmax(c_h @ model.get_input_embeddings().weight.T, -1)
        nll = -torch.stack([logp[j - 1, c_ids[j]] for j in range(n_prompt, len(c_ids))]).mean()
    sp = torch.nn.functional.softplus
    want = sp(r_s[-1] - c_s[-1]) + 2.0 * sp(r_s[t] - c_s[t]) + 0.5 * nll
    assert c_ids[:t] == r_ids[:t] and c_ids[t] != r_ids[t]
    # rel 1e-6, not float64's 1e-9: the scores and token log-probs of the loss are float32 by design
    assert loss == pytest.approx(float(want), rel=1e-6)


def test_aux_terms_need_a_decoder_with_a_score_head(tok):
    class NoHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)
            self.config = type("C", (), {"pad_token_id": 0})()

    with pytest.raises(ValueError, match="need a decoder sequence classifier"):
        accumulate_pair_gradients(NoHead(), tok, PAIRS[:1], microbatch_size=1, lm_coef=1.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        train_reward_model(rm(tok), tok, PAIRS, steps=1, lm_coef=-1.0)


def test_training_learns_refusal_and_generalizes_to_heldout_prompts(tok):
    task = ArithTask()
    train = refusal_pairs(task, random.Random(0), 120 * 16)
    heldout = refusal_pairs(task, random.Random(1), 200, split="eval")
    model = rm(tok)
    before, _ = evaluate_pairs(model, tok, heldout)
    result = train_reward_model(model, tok, train, steps=120, batch_size=16, microbatch_size=16, lr=1e-3,
                                seed=0, eval_pairs=heldout)
    assert len(result.train_losses) == 120
    assert sum(result.train_losses[-10:]) < 0.7 * sum(result.train_losses[:10])
    assert result.heldout_accuracy > max(0.75, before + 0.2), (before, result.heldout_accuracy)
    assert result.heldout_margin > 0
    assert (result.heldout_accuracy, result.heldout_margin) == pytest.approx(evaluate_pairs(model, tok, heldout))


def test_bad_training_arguments(tok):
    model = rm(tok)
    with pytest.raises(ValueError, match="exactly one of steps or epochs"):
        train_reward_model(model, tok, PAIRS, steps=2, epochs=1.0)
    with pytest.raises(ValueError, match="not a multiple of microbatch_size"):
        train_reward_model(model, tok, PAIRS, steps=1, batch_size=8, microbatch_size=3)
    result = train_reward_model(model, tok, PAIRS, epochs=2.0, batch_size=4, microbatch_size=2)
    assert len(result.train_losses) == 4 and result.heldout_accuracy is None


def test_built_from_a_causal_lm_keeps_its_backbone(tok, tmp_path):
    lm = build_tiny_model(tok, seed=3, **TINY)
    model = build_reward_model(lm, tok, seed=0)
    for name, value in lm.model.state_dict().items():
        torch.testing.assert_close(model.model.state_dict()[name], value)
    lm.save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    from_path = build_reward_model(tmp_path / "lm", tok, seed=0)
    torch.testing.assert_close(from_path.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert type(from_path).__name__ == "Qwen2ForSequenceClassification"
    with pytest.raises(ValueError, match="apply only"):
        build_reward_model(tmp_path / "lm", tok, hidden_size=8)


def test_save_and_load_round_trip(tok, tmp_path):
    model = rm(tok, seed=1).eval()
    out = save_reward_model(model, tok, tmp_path / "rm", info={"score_mean": 0.5, "score_std": 2.0})
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert json.loads((out / RM_INFO_FILE).read_text()) == {"append_eos": True, "score_mean": 0.5, "score_std": 2.0}
    loaded, ltok, info = load_reward_model(out)
    prompts, completions = ["1+2=", "7/0=", "12*12="], ["3", "cannot", ""]
    torch.testing.assert_close(score_texts(loaded, ltok, prompts, completions),
                               score_texts(model, tok, prompts, completions))
    assert info["score_std"] == 2.0
    save_reward_model(model, tok, out)  # an existing reward-model folder is replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a reward-model folder"):
        save_reward_model(model, tok, tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_reward_model(tmp_path / "nowhere")


def test_cli_trains_saves_and_reports(tmp_path, capsys):
    import argparse

    from grpolab.cli import rm as cli_rm

    parser = argparse.ArgumentParser()
    cli_rm.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "rm"
    args = parser.parse_args(["rm", "--data", "builtin:refusal", "--out", str(out), "--steps", "3",
                              "--batch-size", "4", "--microbatch-size", "2", "--hidden-size", "16",
                              "--num-layers", "1", "--heldout-pairs", "20"])
    assert args.fn(args) == 0
    printed = capsys.readouterr().out
    assert "held-out pairwise accuracy: " in printed and "(20 pairs)" in printed
    info = json.loads((out / RM_INFO_FILE).read_text())
    assert info["train_pairs"] == 12 and info["score_std"] > 0
    model, _, _ = load_reward_model(out)
    assert model.config.hidden_size == 16
    assert load_train_pairs(out) and len(load_train_pairs(out)) == 12  # what rm_refresh replays
    bad = parser.parse_args(["rm", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")])
    assert bad.fn(bad) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_cli_reports_pair_accuracy_on_a_policys_samples(tmp_path, capsys):
    """--policy: the RM's pair accuracy on the policy's own samples, judged by the task's answer check."""
    import argparse

    from grpolab.cli import rm as cli_rm

    tok = build_char_tokenizer()
    policy = build_tiny_model(tok, seed=0, **TINY)
    policy.save_pretrained(tmp_path / "pi")
    tok.save_pretrained(tmp_path / "pi")
    parser = argparse.ArgumentParser()
    cli_rm.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["rm", "--data", "builtin:accuracy", "--out", str(tmp_path / "rm"), "--steps", "2",
                              "--batch-size", "4", "--hidden-size", "16", "--num-layers", "1", "--heldout-pairs", "8",
                              "--policy", str(tmp_path / "pi"), "--policy-prompts", "16", "--policy-samples", "4"])
    assert args.fn(args) == 0
    info = json.loads((tmp_path / "rm" / RM_INFO_FILE).read_text())["policy_pair_accuracy"]
    assert info["labeler"] == "exact_match" and info["prompts"] == 16 and info["samples"] == 4
    assert info["policy"] == str(tmp_path / "pi") and "accuracy" in info  # NaN here: a random policy is never right (values: test_rm_eval)
    assert "pair accuracy on the policy's samples" in capsys.readouterr().out


def test_sft_backbone_sees_only_the_training_side(tok, monkeypatch):
    from grpolab.sft import sft
    from grpolab.app.demo_reward_models import sft_backbone

    task = ArithTask(ops="+-", answer_lsb_first=True)
    seen = {}

    def fake_train_sft(model, tokenizer, pairs, **kw):
        seen.update(pairs=list(pairs), **kw)
        return [0.0]

    monkeypatch.setattr(sft, "train_sft", fake_train_sft)
    lm = sft_backbone(task, tok, seed=0, steps=5, batch_size=40, refusal_share=0.25, size=TINY)
    assert not lm.training and lm.config.hidden_size == TINY["hidden_size"]
    pairs = seen["pairs"]
    assert len(pairs) == 200 and seen["steps"] == 5 and seen["batch_size"] == 40
    train_prompts = {it.prompt for it in task.items("train")}
    eval_prompts = {it.prompt for it in task.items("eval")}
    assert all(p in train_prompts and p not in eval_prompts for p, _ in pairs)
    assert sum(c == "cannot" for _, c in pairs) == 50
    answers = {it.prompt: it.meta["answer"] for it in task.items("train") if it.meta["answerable"]}
    assert all(c == answers[p] for p, c in pairs if c != "cannot")  # clean answers


def test_policy_wrong_pairs_reject_the_policys_own_training_side_mistakes(tok):
    from grpolab.app.demo_reward_models import policy_wrong_pairs

    task = ArithTask(ops="+-", answer_lsb_first=True)
    policy = build_tiny_model(tok, seed=0, **TINY)  # untrained: almost every sample is a mistake
    pairs = policy_wrong_pairs(policy, tok, task, prompts=20, group_size=4, seed=0)
    answers = {it.prompt: it.meta["answer"] for it in task.items("train") if it.meta["answerable"]}
    assert 20 <= len(pairs) <= 80
    assert all(p.prompt in answers and p.chosen == answers[p.prompt] != p.rejected for p in pairs)
    assert len({(p.prompt, p.rejected) for p in pairs}) == len(pairs)  # distinct mistakes per prompt
    assert pairs == policy_wrong_pairs(policy, tok, task, prompts=20, group_size=4, seed=0)  # seeded


def test_demo_reward_models_contract_with_a_small_budget(tok, tmp_path):
    task = ArithTask(ops="+-", answer_lsb_first=True)
    lines = []
    policy = build_tiny_model(tok, seed=0, **TINY)
    out = build_demo_reward_models(task, tok, tmp_path, seed=0, backbone="sft", steps=2, batch_size=4,
                                   heldout_pairs=40, sft={"steps": 2, "batch_size": 8, "size": TINY},
                                   progress=lines.append, policy=policy)
    assert set(out) == {"accuracy_rm", "refusal_rm"} and len(lines) == 3 and "SFT backbone" in lines[0]
    for key, name in (("accuracy_rm", "accuracy"), ("refusal_rm", "refusal")):
        r = out[key]
        assert {"path", "heldout_accuracy", "margin", "by_kind", "seconds"} <= set(r)
        info = json.loads((tmp_path / f"rm_{name}" / RM_INFO_FILE).read_text())
        assert info["base"] == "sft:builtin:tiny" and info["steps"] == 2 and info["heldout_pairs"] == 40
        assert info["policy_share"] == (0.5 if name == "accuracy" else 0.0)
        model, _, _ = load_reward_model(r["path"])
        assert model.config.hidden_size == TINY["hidden_size"]
    assert set(out["accuracy_rm"]["by_kind"]) <= {"number", "junk", "refusal", "unanswerable"}
    with pytest.raises(ValueError, match="backbone must be"):
        build_demo_reward_models(task, tok, tmp_path, backbone="pi0")
    with pytest.raises(ValueError, match="unknown keys"):
        build_demo_reward_models(task, tok, tmp_path, backbone="fresh", steps={"accuracy": 3})
    with pytest.raises(ValueError, match="apply only to backbone='sft'"):
        build_demo_reward_models(task, tok, tmp_path, backbone="fresh", sft={"steps": 2})
    with pytest.raises(ValueError, match="base applies only to backbone='fresh'"):
        build_demo_reward_models(task, tok, tmp_path, base="some/folder")


def test_demo_process_and_ensemble_accuracy_rms(tok, tmp_path):
    """accuracy="process": one RM folder marked kind=process, scored by its weakest step;
    accuracy="ensemble": K member folders, the entry's paths list them."""
    task = ArithTask(ops="+-", answer_lsb_first=True)
    small = dict(seed=0, backbone="sft", steps=2, batch_size=4, heldout_pairs=40,
                 sft={"steps": 2, "batch_size": 8, "size": TINY})
    out = build_demo_reward_models(task, tok, tmp_path / "p", accuracy="process", **small)
    info = json.loads((tmp_path / "p" / "rm_accuracy" / RM_INFO_FILE).read_text())
    assert info["kind"] == "process" and info["score_std"] > 0 and 0 <= out["accuracy_rm"]["heldout_accuracy"] <= 1
    assert "kind" not in json.loads((tmp_path / "p" / "rm_refusal" / RM_INFO_FILE).read_text())
    out = build_demo_reward_models(task, tok, tmp_path / "e", accuracy="ensemble", ensemble_size=2, **small)
    paths = out["accuracy_rm"]["paths"]
    assert [Path(p).name for p in paths] == ["rm_accuracy_0", "rm_accuracy_1"]
    a, b = (load_reward_model(p)[0].score.weight for p in paths)
    assert not torch.equal(a, b)  # members differ (seeded apart)
    with pytest.raises(ValueError, match="accuracy must be one of"):
        build_demo_reward_models(task, tok, tmp_path, accuracy="process", backbone="fresh")


@pytest.mark.slow
def test_demo_reward_models(tok, tmp_path):
    """The demo's "fresh" recipe (the default "sft" one takes about 8 minutes) on the demo's task
    (ops "+-", LSB-first answers): about 30 s on an idle 2-core CPU. The refusal RM ranks >= 95% of
    held-out pairs right. The accuracy RM does on every kind of pair but "number" (the right answer
    against another integer on held-out facts): 0.67 / 0.64 there, 0.859 / 0.843 overall (seeds
    0, 1), because single-digit differences stay near chance; see build_demo_reward_models."""
    from grpolab.data.build import arith_task
    from grpolab.app.demo import demo_config

    out = build_demo_reward_models(arith_task(demo_config()), tok, tmp_path, seed=0, backbone="fresh")
    assert out["refusal_rm"]["heldout_accuracy"] >= 0.95, out
    acc = out["accuracy_rm"]["by_kind"]
    assert all(v >= 0.95 for k, v in acc.items() if k != "number"), acc
    # "number" pairs stay near chance (0.5): 0.67 / 0.64 on AVX-512 hosts, 0.584 on an AVX2-only one
    # (other float rounding, another trajectory), so the bar is "above chance", not a seed's figure.
    assert acc["number"] >= 0.55 and out["accuracy_rm"]["heldout_accuracy"] >= 0.8, out
    for name in ("accuracy", "refusal"):
        info = json.loads((tmp_path / f"rm_{name}" / RM_INFO_FILE).read_text())
        assert info["score_std"] > 0 and info["heldout_accuracy"] == out[f"{name}_rm"]["heldout_accuracy"]
