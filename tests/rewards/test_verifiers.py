import time

import pytest

from grpolab.rewards.base import build_reward, reward_names
from grpolab.rewards.verifiers import (
    extract_answer,
    extract_answer_colon,
    extract_boxed,
    extract_last_number,
    gold_latex,
)


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed {x^{2}}", "x^{2}"),
    (r"\boxed{unclosed", None),
    (r"\boxed{}", None),
    ("no box", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Answer: 5", "5"),
    ("answer: 3\nthen\n**Answer:** 7.", "7"),
    ("Final answer： x+1", "x+1"),
    ("Answer:   \n", None),
    ("The answers are many", None),
])
def test_extract_answer_colon(text, expected):
    assert extract_answer_colon(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("4 - 1 = 3.", "3"),
    ("it is -12", "-12"),
    ("about 3.5 and 1,234 units", "1234"),
    ("1,2", "2"),
    ("none", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_extract_answer_modes():
    text = r"Answer: 8 since 2+3 gives \boxed{5} ... 9"
    assert extract_answer(text, "boxed") == "5"
    assert extract_answer(text, "answer_colon") == r"8 since 2+3 gives \boxed{5} ... 9"
    assert extract_answer(text, "last_number") == "9"
    assert extract_answer(text, "auto") == "5"
    assert extract_answer("Answer: 8 then 9", "auto") == "8 then 9"
    assert extract_answer("  7 \n", "strip") == "7"
    with pytest.raises(ValueError, match="unknown answer extraction mode 'bogus'"):
        extract_answer("x", "bogus")


def test_answer_format_registered():
    assert {"answer_format", "reasoning_gym", "math_verify"} <= set(reward_names())
    fn = build_reward("answer_format")
    out = fn(["p"] * 3, [r"\boxed{3}", "3", r"\boxed{3}"], [{}, {}, {"truncated": True}])
    assert out == [1.0, 0.0, 0.0]
    assert build_reward("answer_format", extract="last_number")(["p"], ["x 3"], [{}]) == [1.0]
    with pytest.raises(ValueError, match="extract"):
        build_reward("answer_format", extract="nope")


def test_reasoning_gym_chain_sum():
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (grpolab[tasks])")
    from grpolab.data.sources import reasoning_gym_items

    items = reasoning_gym_items("chain_sum", size=4, seed=11, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    fn = build_reward("reasoning_gym")
    prompts = [it.prompt for it in items]
    metas = [it.meta for it in items]
    golds = [m["rg_entry"]["answer"] for m in metas]
    assert fn(prompts, golds, metas) == [1.0] * 4
    assert fn(prompts, [f"The result is {g}." for g in golds], metas) == [1.0] * 4
    assert fn(prompts, [str(int(g) + 1) for g in golds], metas) == [0.0] * 4
    assert fn(prompts, ["no idea"] * 4, metas) == [0.0] * 4
    truncated = [dict(m, truncated=True) for m in metas]
    assert fn(prompts, golds, truncated) == [0.0] * 4
    assert fn(["p"], ["3"], [{"answer": "3"}]) == [None]  # not a reasoning-gym row: abstain

    # partial credit (the task gives "-4 apples" a fraction for containing "-4") counts as wrong
    import reasoning_gym

    partial = reasoning_gym.get_score_answer_fn("chain_sum")(golds[0] + " apples", metas[0]["rg_entry"])
    assert 0.0 < partial < 1.0
    strict = build_reward("reasoning_gym", extract="strip")
    assert strict(prompts[:1], [golds[0] + " apples"], metas[:1]) == [0.0]
    assert strict(prompts[:1], [golds[0]], metas[:1]) == [1.0]


@pytest.fixture(scope="module")
def math_reward():
    pytest.importorskip("math_verify", reason="math-verify is not installed (grpolab[tasks])")
    fn = build_reward("math_verify", timeout_s=2.0)
    yield fn
    fn.close()


def test_math_verify_correct_and_wrong(math_reward):
    completions = [r"so the answer is \boxed{\frac{1}{2}}", "it is 0.5", r"\boxed{3}", "", "x", "4"]
    metas = [{"answer": "0.5"}, {"answer": r"$\frac{1}{2}$"}, {"answer": "4"}, {"answer": "1"}, {}, {"answer": 4}]
    assert math_reward(["p"] * 6, completions, metas) == [1.0, 1.0, 0.0, 0.0, None, 1.0]
    assert gold_latex("0.5") == "$0.5$" and gold_latex(r"\boxed{2}") == r"\boxed{2}"


def test_math_verify_timeout_scores_zero_and_recovers(math_reward):
    math_reward(["p"], ["1"], [{"answer": "1"}])  # the verifier process is up
    restarts = math_reward.worker.restarts
    start = time.monotonic()
    # sympy tries to decide 3 == 9^(9^9) exactly: minutes of work without a timeout
    out = math_reward(["p"], [r"$9^{9^{9}}$"], [{"answer": "3"}])
    elapsed = time.monotonic() - start
    assert out == [0.0]
    assert elapsed < 2.0 + 1.5  # the per-row limit plus the kill, not the minutes sympy would take
    assert math_reward.worker.restarts == restarts + 1
    assert math_reward(["p", "p"], [r"\boxed{7}", "8"], [{"answer": "7"}, {"answer": "7"}]) == [1.0, 0.0]


def test_math_verify_bad_arguments():
    pytest.importorskip("math_verify", reason="math-verify is not installed (grpolab[tasks])")
    with pytest.raises(ValueError, match="timeout_s"):
        build_reward("math_verify", timeout_s=0)
