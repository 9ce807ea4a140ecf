import collections
import random
import re

import pytest

from grpolab.data.arith import (
    EVAL,
    REFUSAL,
    TRAIN,
    ArithTask,
    PromptItem,
    split_of,
    target_completion,
    wrong_answer,
)
from grpolab.models.tiny import build_char_tokenizer, encode_checked

ALL_KINDS = ("div_by_zero", "missing_operand", "unknown_operand")


@pytest.fixture(scope="module")
def task():
    return ArithTask(unanswerable_kinds=ALL_KINDS)


@pytest.fixture(scope="module")
def sides(task):
    return {s: {it.prompt: it for it in task.items(s)} for s in (TRAIN, EVAL)}


def _operands(prompt: str):
    m = re.fullmatch(r"([0-9?]*)([-+*/])([0-9?]*)=", prompt)
    assert m, prompt
    return m.group(1), m.group(2), m.group(3)


def test_split_is_disjoint_over_the_whole_fact_space(task, sides):
    train, held = sides[TRAIN], sides[EVAL]
    assert not set(train) & set(held)
    n_all = len(task.items(TRAIN)) + len(task.items(EVAL))
    assert len(train) + len(held) == n_all  # every prompt appears once in the fact space
    # the full space is what it should be: + 100², - 5050, * 13², / 12*13, /0 145, missing & unknown
    ranges = {"+": (100, 100), "-": (100, 100), "*": (13, 13), "/": (145, 12)}
    expected = 100 * 100 + 5050 + 13 * 13 + 12 * 13 + 145 + 2 * sum(a + b for a, b in ranges.values())
    assert n_all == expected
    assert 0.17 < len(held) / n_all < 0.23  # eval_fraction = 0.2


def test_commuted_twins_share_a_side(sides):
    side_of = {p: s for s, items in sides.items() for p in items}
    for p, s in side_of.items():
        a, op, b = _operands(p)
        if op in "+*" and a.isdigit() and b.isdigit():
            assert side_of[f"{b}{op}{a}="] == s, p


def test_split_depends_only_on_seed_and_fact():
    small = ArithTask(ops="+", add_max=30, pad_operands=False)
    big = ArithTask(ops="+", add_max=99, pad_operands=False)
    big_side = {it.prompt: s for s in (TRAIN, EVAL) for it in big.items(s)}
    for s in (TRAIN, EVAL):
        for it in small.items(s):
            assert big_side[it.prompt] == s
    other = ArithTask(ops="+", add_max=30, pad_operands=False, seed=1)
    assert {it.prompt for it in other.items(EVAL)} != {it.prompt for it in small.items(EVAL)}
    assert split_of("+|3|7", 0, 0.2) == split_of("+|3|7", 0, 0.2)


def test_meta_is_right_for_every_prompt(task, sides):
    for items in sides.values():
        for p, it in items.items():
            a, op, b = _operands(p)
            assert it.meta["op"] == op
            if it.meta["answerable"]:
                x, y = int(a), int(b)
                value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y if y else None}[op]
                assert it.meta["answer"] == str(value), p
                assert op != "/" or x % y == 0
                assert op != "-" or value >= 0
                assert it.meta["kind"] == {"+": "add", "-": "sub", "*": "mul", "/": "div"}[op]
            else:
                assert it.meta["answer"] is None
                if it.meta["kind"] == "div_by_zero":
                    assert op == "/" and int(b) == 0 and a.isdigit()
                elif it.meta["kind"] == "missing_operand":
                    assert (a == "") != (b == "")
                else:
                    assert it.meta["kind"] == "unknown_operand" and "?" in (a, b)
            assert target_completion(it.meta) == (it.meta["answer"] if it.meta["answerable"] else REFUSAL)


def test_padded_format_and_tokenizable(task, sides):
    tok = build_char_tokenizer()
    assert sides[TRAIN].get("07+45=") or sides[EVAL].get("07+45=")
    assert "056/08=" in sides[TRAIN] or "056/08=" in sides[EVAL]
    for items in sides.values():
        for p, it in items.items():
            encode_checked(tok, p + target_completion(it.meta))
    plain = ArithTask(pad_operands=False)
    assert any(it.prompt == "7+45=" for s in (TRAIN, EVAL) for it in plain.items(s))


def test_sub_negative():
    task = ArithTask(ops="-", sub_max=9, sub_negative=True, unanswerable_share=0.0)
    answers = [int(it.meta["answer"]) for s in (TRAIN, EVAL) for it in task.items(s) if it.meta["answerable"]]
    assert len(answers) == 100 and min(answers) == -9


def test_train_prompts_come_from_train_side_with_the_configured_share(task, sides):
    items = task.train_prompts(random.Random(0), 4000)
    assert all(it.prompt in sides[TRAIN] for it in items)
    assert all(it == sides[TRAIN][it.prompt] for it in items)
    share = sum(not it.meta["answerable"] for it in items) / len(items)
    assert abs(share - task.unanswerable_share) < 0.03
    ops = collections.Counter(it.meta["op"] for it in items if it.meta["answerable"])
    assert set(ops) == set("+-*/") and min(ops.values()) > 0.2 * 3000
    kinds = collections.Counter(it.meta["kind"] for it in items if not it.meta["answerable"])
    assert set(kinds) == set(ALL_KINDS)
    items[0].meta["truncated"] = True  # callers may annotate their copies: the pools stay clean
    assert all("truncated" not in it.meta for s in (TRAIN, EVAL) for it in task.items(s))
    again = task.train_prompts(random.Random(0), 4000)
    assert [it.prompt for it in again] == [it.prompt for it in items]


def test_sft_examples_train_side_refusals_and_noise(task, sides):
    pairs = task.sft_examples(random.Random(1), 1000, refusal_examples=7, answer_noise=0.1)
    assert len(pairs) == 1000
    assert all(p in sides[TRAIN] for p, _ in pairs)
    refusals = [p for p, c in pairs if c == REFUSAL]
    assert len(refusals) == 7 and all(not sides[TRAIN][p].meta["answerable"] for p in refusals)
    wrong = [(p, c) for p, c in pairs if c != REFUSAL and c != sides[TRAIN][p].meta["answer"]]
    assert len(wrong) == round(993 * 0.1)
    assert all(re.fullmatch(r"-?\d+", c) for _, c in wrong)
    shared = task.sft_examples(random.Random(1), 200, refusal_examples=0.05)
    assert sum(c == REFUSAL for _, c in shared) == 10
    assert all(c == sides[TRAIN][p].meta["answer"] for p, c in shared if c != REFUSAL)


def test_sft_examples_bad_knobs(task):
    rng = random.Random(0)
    with pytest.raises(ValueError, match="refusal_examples"):
        task.sft_examples(rng, 10, refusal_examples=11)
    with pytest.raises(ValueError, match="refusal_examples"):
        task.sft_examples(rng, 10, refusal_examples=1.5)
    with pytest.raises(ValueError, match="refusal_examples"):
        task.sft_examples(rng, 10, refusal_examples=True)
    with pytest.raises(ValueError, match="answer_noise"):
        task.sft_examples(rng, 10, answer_noise=-0.1)


def test_eval_items_held_out_distinct_deterministic(task, sides):
    items = task.eval_items(400, seed=0)
    prompts = [it.prompt for it in items]
    assert len(set(prompts)) == 400
    assert all(p in sides[EVAL] for p in prompts)
    assert sum(not it.meta["answerable"] for it in items) == round(400 * task.unanswerable_share)
    assert set(it.meta["kind"] for it in items) == {"add", "sub", "mul", "div", *ALL_KINDS}
    assert [it.prompt for it in task.eval_items(400, seed=0)] == prompts
    assert set(it.prompt for it in task.eval_items(400, seed=1)) != set(prompts)
    with pytest.raises(ValueError, match="held out"):
        task.eval_items(10**6)


def _plausible(w: str, ans: str) -> bool:
    one_digit = len(w) == len(ans) and sum(a != b for a, b in zip(w, ans)) == 1
    return abs(int(w) - int(ans)) in (1, 10) or sorted(w) == sorted(ans) or one_digit


def test_wrong_answer_is_plausible_and_wrong():
    rng = random.Random(0)
    for ans in ["0", "1", "9", "10", "82", "100", "144", "-5", "-13"]:
        seen = set()
        for _ in range(60):
            w = wrong_answer(rng, ans)
            assert w != ans and re.fullmatch(r"0|-?[1-9]\d*", w)
            assert ans.startswith("-") or not w.startswith("-")
            assert _plausible(w, ans), (ans, w)
            seen.add(w)
        assert len(seen) >= 5, (ans, seen)  # offsets, swaps and replaced digits all turn up


def test_wrong_answer_lsb_first_errs_in_every_digit_position():
    rng = random.Random(0)
    for ans in ["601", "97", "0", "-31"]:  # LSB first: 106, 79, 0, -13
        value = int(ans[0] + ans[1:][::-1]) if ans.startswith("-") else int(ans[::-1])
        wrong = [wrong_answer(rng, ans, lsb_first=True) for _ in range(300)]
        for w in wrong:
            msb = ("-" + w[1:][::-1]) if w.startswith("-") else w[::-1]
            assert w != ans and re.fullmatch(r"0|-?[1-9]\d*", msb), (ans, w)
            assert _plausible(msb, str(value)), (ans, w)
        body = ans.lstrip("-")
        for pos in range(len(body)):  # each written position is the wrong one sometimes
            assert any(len(w.lstrip("-")) == len(body) and w.lstrip("-")[pos] != body[pos] for w in wrong), (ans, pos)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"ops": "+%"}, "ops"),
        ({"ops": "++"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"mul_max": 0}, "mul_max"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"unanswerable_share": -0.1}, "unanswerable_share"),
        ({"unanswerable_kinds": ("nonsense",)}, "unanswerable_kinds"),
        ({"unanswerable_share": 0.2, "unanswerable_kinds": ()}, "unanswerable_kinds"),
    ],
)
def test_bad_task_knobs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithTask(**kwargs)


def test_div_by_zero_without_division_facts():
    task = ArithTask(ops="+-", unanswerable_kinds=("div_by_zero",), unanswerable_share=0.5)
    items = task.eval_items(20)
    assert {it.meta["kind"] for it in items} == {"add", "sub", "div_by_zero"}
    assert all("/" in it.prompt for it in items if not it.meta["answerable"])


def test_lsb_first_answers():
    task = ArithTask(ops="+-", answer_lsb_first=True)
    for it in task.items("train")[:200]:
        a, op, b = it.prompt[:2], it.prompt[2], it.prompt[3:5]
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert it.meta["answer"] == str(value)[::-1]


def test_prompt_item_is_frozen_and_comparable():
    a = PromptItem("1+2=", {"answer": "3"})
    assert a == PromptItem("1+2=", {"answer": "3"})
    with pytest.raises(AttributeError):
        a.prompt = "x"
    assert ArithTask(unanswerable_kinds=["missing_operand"]).unanswerable_kinds == ("missing_operand",)
