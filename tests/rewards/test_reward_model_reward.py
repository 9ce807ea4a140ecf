import random

import pytest
import torch

from grpolab.data.arith import ArithTask
from grpolab.data.preferences import refusal_pairs
from grpolab.models.tiny import build_char_tokenizer
from grpolab.rewards.base import build_reward, reward_names, score_batch
from grpolab.rewards.reward_model import RewardModelReward
from grpolab.reward_models.model import build_reward_model, save_reward_model, score_texts
from grpolab.reward_models.training import score_stats, train_reward_model
from grpolab.app.demo_reward_models import torch_threads

PROMPTS = ["12+07=", "5/00=", "+4=", "03*04=", "99-09=", "144/12="]
COMPLETIONS = ["19", "cannot", "", "12", "1234567", "can"]
META = [{"answerable": True, "answer": "19", "truncated": False}] * len(PROMPTS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):  # tiny models: one thread is fastest (and much faster on a busy machine)
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny RM trained a few steps, saved with its score statistics: (in-memory model, tokenizer, path)."""
    tok = build_char_tokenizer()
    model = build_reward_model("builtin:tiny", tok, seed=0, hidden_size=32, num_layers=1, num_heads=4)
    pairs = refusal_pairs(ArithTask(), random.Random(0), 64)
    train_reward_model(model, tok, pairs, steps=4, batch_size=16, microbatch_size=16, lr=3e-3)
    mean, std = score_stats(model, tok, pairs)
    path = tmp_path_factory.mktemp("rm") / "rm_refusal"
    save_reward_model(model, tok, path, info={"score_mean": mean, "score_std": std})
    return model, tok, path


def test_registered_and_scores_like_the_in_memory_model(saved):
    model, tok, path = saved
    assert "reward_model" in reward_names()
    fn = build_reward("reward_model", path=str(path))
    assert isinstance(fn, RewardModelReward) and fn.name == "reward_model"
    got = score_batch(fn, PROMPTS, COMPLETIONS, META)
    torch.testing.assert_close(got, score_texts(model, tok, PROMPTS, COMPLETIONS))
    assert got.std() > 0  # not a constant


def test_batching_does_not_change_scores(saved):
    _, _, path = saved
    one = RewardModelReward(str(path), batch_size=1)(PROMPTS, COMPLETIONS, META)
    many = RewardModelReward(str(path), batch_size=64)(PROMPTS, COMPLETIONS, META)
    torch.testing.assert_close(torch.tensor(one), torch.tensor(many))
    assert RewardModelReward(str(path))([], [], []) == []


def test_normalization(saved):
    _, _, path = saved
    def scores(**kw):
        return torch.tensor(RewardModelReward(str(path), **kw)(PROMPTS, COMPLETIONS, META), dtype=torch.float64)

    raw, batch = scores(), scores(normalize="batch")
    torch.testing.assert_close(batch, (raw - raw.mean()) / (raw.std(correction=0) + 1e-6))
    assert abs(float(batch.mean())) < 1e-6
    fixed = RewardModelReward(str(path), normalize="fixed")
    assert fixed.std > 0 and (fixed.mean, fixed.std) != (0.0, 1.0)  # read from grpolab_rm.json
    torch.testing.assert_close(torch.tensor(fixed(PROMPTS, COMPLETIONS, META), dtype=torch.float64),
                               (raw - fixed.mean) / fixed.std)
    override = RewardModelReward(str(path), normalize="fixed", mean=1.0, std=2.0)
    torch.testing.assert_close(torch.tensor(override(PROMPTS, COMPLETIONS, META), dtype=torch.float64),
                               (raw - 1.0) / 2.0)


def test_errors_name_the_path_at_construction(saved, tmp_path):
    model, tok, _ = saved
    missing = tmp_path / "no_such_rm"
    with pytest.raises(FileNotFoundError, match="no_such_rm"):
        build_reward("reward_model", path=str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        RewardModelReward(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="normalize must be one of"):
        RewardModelReward(str(saved[2]), normalize="group")
    bare = save_reward_model(model, tok, tmp_path / "bare")  # no score statistics saved
    with pytest.raises(ValueError, match="score_mean/score_std"):
        RewardModelReward(str(bare), normalize="fixed")
    with pytest.raises(ValueError, match="std > 0"):
        RewardModelReward(str(bare), normalize="fixed", mean=0.0, std=0.0)


def test_an_ensemble_combines_its_members_normalized_scores(saved, tmp_path):
    """Two RMs (another seed for the second): the ensemble's reward is the mode applied to each member's
    own fixed-normalized scores; fewer than two members or an unknown mode are refused at build time."""
    from grpolab.rewards.reward_model import RewardModelEnsemble

    _, tok, first = saved
    model = build_reward_model("builtin:tiny", tok, seed=1, hidden_size=32, num_layers=1, num_heads=4)
    pairs = refusal_pairs(ArithTask(), random.Random(1), 64)
    train_reward_model(model, tok, pairs, steps=4, batch_size=16, microbatch_size=16, lr=3e-3)
    mean, std = score_stats(model, tok, pairs)
    second = tmp_path / "rm_b"
    save_reward_model(model, tok, second, info={"score_mean": mean, "score_std": std})
    members = torch.stack([torch.tensor(RewardModelReward(str(p), normalize="fixed")(PROMPTS, COMPLETIONS, META),
                                        dtype=torch.float64) for p in (first, second)])
    assert not torch.allclose(members[0], members[1])
    fn = build_reward("reward_model_ensemble", paths=[str(first), str(second)], mode="mean_minus_std", lam=0.5)
    got = torch.tensor(fn(PROMPTS, COMPLETIONS, META), dtype=torch.float64)
    torch.testing.assert_close(got, members.mean(0) - 0.5 * members.std(0, correction=0))
    worst = build_reward("reward_model_ensemble", paths=[str(first), str(second)], mode="min")
    torch.testing.assert_close(torch.tensor(worst(PROMPTS, COMPLETIONS, META), dtype=torch.float64),
                               members.min(0).values)
    with pytest.raises(ValueError, match="at least two"):
        RewardModelEnsemble([str(first)])
    with pytest.raises(ValueError, match="mode must be one of"):
        RewardModelEnsemble([str(first), str(second)], mode="median")


def test_clip_bounds_the_normalized_scores(saved):
    _, _, path = saved
    raw = torch.tensor(RewardModelReward(str(path), normalize="fixed")(PROMPTS, COMPLETIONS, META))
    lim = float(raw.abs().max()) / 2  # halfway: some scores are cut, others not
    got = torch.tensor(RewardModelReward(str(path), normalize="fixed", clip=lim)(PROMPTS, COMPLETIONS, META))
    torch.testing.assert_close(got, raw.clamp(-lim, lim))
    assert (got != raw).any()
    with pytest.raises(ValueError, match="clip must be > 0"):
        RewardModelReward(str(path), clip=0.0)


def test_calibrated_scores_and_the_verifier_threshold(saved, tmp_path):
    model, tok, path = saved
    with pytest.raises(ValueError, match="no calibration"):
        RewardModelReward(str(path), normalize="calibrated")
    save_reward_model(model, tok, tmp_path / "cal", info={"calibration": [2.0, -0.5]})
    raw = score_texts(model, tok, PROMPTS, COMPLETIONS).double()
    prob = torch.tensor(RewardModelReward(str(tmp_path / "cal"), normalize="calibrated")(PROMPTS, COMPLETIONS, META),
                        dtype=torch.float64)
    torch.testing.assert_close(prob, torch.sigmoid(2.0 * raw - 0.5))
    cut = float(prob.median())
    got = RewardModelReward(str(tmp_path / "cal"), normalize="calibrated", threshold=cut)(PROMPTS, COMPLETIONS, META)
    assert got == [float(p > cut) for p in prob] and 0 < sum(got) < len(got)
