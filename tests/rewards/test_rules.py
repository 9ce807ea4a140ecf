import math

import pytest

from grpolab.data.arith import REFUSAL, ArithTask, target_completion
from grpolab.rewards.base import build_reward, combine, reward_names, score_batch
from grpolab.rewards.rules import ExactMatch, Format, Refusal, is_correct, is_integer, is_refusal


def ans(answer: str, truncated: bool = False) -> dict:
    return {"answer": answer, "answerable": True, "op": "+", "kind": "add", "truncated": truncated}


def unans(truncated: bool = False) -> dict:
    return {"answer": None, "answerable": False, "op": "/", "kind": "div_by_zero", "truncated": truncated}


def test_registered_by_name():
    assert {"exact_match", "refusal", "format"} <= set(reward_names())
    assert isinstance(build_reward("exact_match"), ExactMatch)
    assert build_reward("refusal").name == "refusal"
    assert build_reward("format", refusal="no").refusal == "no"
    with pytest.raises(ValueError, match="exact_match"):
        build_reward("exact_match", strict=True)  # kwarg-free


def test_exact_match_hand_cases():
    comps = ["82", " 82 ", "81", "082", "82", "cannot", "7", ""]
    meta = [ans("82"), ans("82"), ans("82"), ans("82"), ans("82", truncated=True), unans(), unans(), ans("0")]
    assert ExactMatch()(["p"] * 8, comps, meta) == [1.0, 1.0, 0.0, 0.0, 0.0, None, None, 0.0]


def test_exact_match_abstentions_become_nan_and_are_skipped_by_combine():
    meta = [ans("3"), unans()]
    em = score_batch(ExactMatch(), ["1+2=", "1/0="], ["3", REFUSAL], meta)
    rf = score_batch(Refusal(), ["1+2=", "1/0="], ["3", REFUSAL], meta)
    assert em[0].item() == 1.0 and math.isnan(em[1].item())
    total = combine({"exact_match": em, "refusal": rf}, {"exact_match": 1.0, "refusal": 0.5})
    assert total.tolist() == [1.5, 0.5]


def test_refusal_hand_cases():
    comps = ["cannot", " cannot\n", "5", "", "cannot", "5", "cannot", "cannot please"]
    meta = [unans(), unans(), unans(), unans(), unans(truncated=True), ans("5"), ans("5"), unans()]
    assert Refusal()(["p"] * 8, comps, meta) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    # a wrong answer is still "not a refusal" (refusal judges the call, not the answer); truncated → 0
    assert Refusal()(["p", "p"], ["4", "4"], [ans("5"), ans("5", truncated=True)]) == [1.0, 0.0]
    assert Refusal(refusal="no")(["p", "p"], ["no", "cannot"], [unans(), unans()]) == [1.0, 0.0]


def test_format_hand_cases():
    comps = ["82", "-5", "0", "cannot", " 7 ", "082", "-0", "8 2", "12a", "", "can not", "82"]
    meta = [ans("82")] * 11 + [ans("82", truncated=True)]
    assert Format()(["p"] * 12, comps, meta) == [1.0, 1.0, 1.0, 1.0, 1.0] + [0.0] * 7


def test_helpers():
    assert is_refusal("cannot") and is_refusal(" cannot ") and not is_refusal("cannot.")
    assert is_integer("-12") and not is_integer("1.5") and not is_integer("")
    assert is_correct("82", ans("82")) and not is_correct("82", ans("82", truncated=True))
    assert is_correct("cannot", unans()) and not is_correct("3", unans())
    assert not is_correct("cannot", ans("82"))
    assert is_correct("82", {"answer": "82", "answerable": True})  # no truncated key: not truncated


def test_gold_completions_score_perfectly_on_the_task():
    items = ArithTask().eval_items(64, seed=0)
    prompts = [it.prompt for it in items]
    comps = [target_completion(it.meta) for it in items]
    meta = [{**it.meta, "truncated": False} for it in items]
    assert all(v in (1.0, None) for v in ExactMatch()(prompts, comps, meta))
    assert Refusal()(prompts, comps, meta) == [1.0] * 64
    assert Format()(prompts, comps, meta) == [1.0] * 64


def test_missing_metadata_is_a_clear_error():
    with pytest.raises(ValueError, match=r"row 1 lacks \['truncated'\]"):
        ExactMatch()(["p", "p"], ["1", "2"], [ans("1"), {"answer": "2", "answerable": True}])
    with pytest.raises(ValueError, match="answerable but its answer is None"):
        ExactMatch()(["p"], ["1"], [{"answer": None, "answerable": True, "truncated": False}])
    with pytest.raises(ValueError, match="2 completions but 1 metadata rows"):
        Refusal()(["p", "p"], ["1", "2"], [ans("1")])
    with pytest.raises(ValueError, match="truncated"):
        Format()(["p"], ["1"], [{"answer": "1", "answerable": True}])
