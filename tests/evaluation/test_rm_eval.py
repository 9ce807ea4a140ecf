"""policy_pair_accuracy: an RM that agrees with the labeler scores 1, one that disagrees 0, on real samples."""

import math

from grpolab.data.arith import PromptItem
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.evaluation.reward_models import policy_pair_accuracy


def _even(prompts, texts, metas):
    return [float(len(t) % 2 == 0) for t in texts]


def _odd(prompts, texts, metas):
    return [float(len(t) % 2 == 1) for t in texts]


def _length(prompts, texts, metas):
    return [float(len(t)) for t in texts]


def test_agreeing_and_disagreeing_rms_on_a_policys_own_samples():
    tok = build_char_tokenizer()
    policy = build_tiny_model(tok, seed=0, hidden_size=32, num_layers=1, num_heads=2)  # random: varied lengths
    items = [PromptItem(f"{i}+1=", {"answerable": True, "answer": str(i + 1)}) for i in range(12)]
    acc = policy_pair_accuracy({"same": _even, "reversed": _odd, "length": _length},
                               {"same": _even, "reversed": _even, "length": _length},
                               policy, tok, items, group_size=6, max_new_tokens=6, seed=0)
    assert acc["same"] == 1.0 and acc["reversed"] == 0.0 and acc["length"] == 1.0
    none = policy_pair_accuracy({"x": _even}, {"x": lambda p, t, m: [1.0] * len(t)}, policy, tok, items,
                                group_size=4, max_new_tokens=6)
    assert math.isnan(none["x"])  # the labeler tells no pair apart
