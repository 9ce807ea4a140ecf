import json
import random

import pytest

from grpolab.data.arith import EVAL, REFUSAL, TRAIN, ArithTask
from grpolab.data.preferences import DataError, PrefPair, accuracy_pairs, load_pairs, refusal_pairs
from grpolab.rewards.rules import is_integer


@pytest.fixture(scope="module")
def task():
    return ArithTask()


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# --------------------------------------------------------------------------- files


def test_plain_jsonl_rows_and_blank_lines(tmp_path):
    f = write(tmp_path / "p.jsonl", [{"prompt": "2+3=", "chosen": "5", "rejected": "6", "id": 1}, "",
                                     {"prompt": "1/0=", "chosen": "cannot", "rejected": "0"}])
    assert load_pairs(f) == [PrefPair("2+3=", "5", "6"), PrefPair("1/0=", "cannot", "0")]


def test_chat_rows_render_the_prompt_and_keep_the_reply_text(tmp_path, tok):
    gen = "<|im_start|>assistant\n"
    f = write(tmp_path / "c.jsonl", [
        {"prompt": "2+3?", "chosen": "5", "rejected": "6"},  # plain prompt -> one user message
        {"prompt": [user("hi")], "chosen": [assistant("hello")], "rejected": "go away"},
        {"chosen": [user("q"), assistant("good")], "rejected": [user("q"), assistant("bad")]},  # implicit prompt
    ])
    pairs = load_pairs(f, tokenizer=tok, system_prompt="S")
    sys_ = "<|im_start|>system\nS<|im_end|>\n"
    assert pairs[0] == PrefPair(sys_ + "<|im_start|>user\n2+3?<|im_end|>\n" + gen, "5", "6")
    assert pairs[1] == PrefPair(sys_ + "<|im_start|>user\nhi<|im_end|>\n" + gen, "hello", "go away")
    assert pairs[2] == PrefPair(sys_ + "<|im_start|>user\nq<|im_end|>\n" + gen, "good", "bad")
    # without a system prompt the template's default is used
    assert "DEFAULT" in load_pairs(f, tokenizer=tok)[0].prompt


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "chosen": "b"}, "missing field(s) ['rejected']"),
    ({"prompt": "a", "chosen": "  ", "rejected": "c"}, "field 'chosen' is empty"),
    ({"prompt": "", "chosen": "b", "rejected": "c"}, "field 'prompt' is empty"),
    ({"chosen": "b", "rejected": "c"}, "missing field 'prompt'"),
    ({"prompt": "a", "chosen": "b", "rejected": "b"}, "identical"),
    ({"prompt": "a", "chosen": [user("x")], "rejected": "c"}, "assistant message"),
    ({"chosen": [user("p"), assistant("x")], "rejected": [user("q"), assistant("y")]}, "differ before"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_rows_name_file_and_line(tmp_path, tok, row, message):
    f = write(tmp_path / "bad.jsonl", [{"prompt": "ok", "chosen": "1", "rejected": "2"}, row])
    with pytest.raises(DataError) as e:
        load_pairs(f, tokenizer=tok)
    assert f"{f}:2: " in str(e.value) and message in str(e.value)


def test_not_json_missing_file_and_no_template(tmp_path):
    f = write(tmp_path / "x.jsonl", ['{"prompt": "a", "chosen": "b", "rejected": "c"}', "{not json"])
    with pytest.raises(DataError, match=r"x\.jsonl:2: not valid JSON"):
        load_pairs(f)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_pairs(tmp_path / "nope.jsonl")
    chat = write(tmp_path / "chat.jsonl", [{"prompt": [user("hi")], "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match=r"chat\.jsonl:1: .*no tokenizer with a chat template"):
        load_pairs(chat)
    with pytest.raises(DataError, match="empty"):
        load_pairs(write(tmp_path / "empty.jsonl", [""]))


def test_parquet_file_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                {"prompt": "2+2=", "chosen": "4", "rejected": ""}]).to_parquet(str(path))
    with pytest.raises(DataError, match=r"p\.parquet\[train\] row 1: field 'rejected' is empty"):
        load_pairs(path)


# --------------------------------------------------------------------------- built-in pairs


def _sides(task):
    return {side: {it.prompt: it for it in task.items(side)} for side in (TRAIN, EVAL)}


@pytest.mark.parametrize("make", [accuracy_pairs, refusal_pairs])
def test_builtin_pairs_stay_on_their_side_of_the_split(task, make):
    sides = _sides(task)
    for side in (TRAIN, EVAL):
        pairs = make(task, random.Random(0), 600, split=side)
        assert len(pairs) == 600
        assert all(p.prompt in sides[side] for p in pairs), side
        assert all(p.chosen != p.rejected for p in pairs)
    assert make(task, random.Random(3), 50) == make(task, random.Random(3), 50)
    with pytest.raises(ValueError, match="split"):
        make(task, random.Random(0), 5, split="test")


def test_accuracy_pairs_prefer_the_correct_response(task):
    items = _sides(task)[TRAIN]
    pairs = accuracy_pairs(task, random.Random(1), 2000)
    unanswerable = [p for p in pairs if not items[p.prompt].meta["answerable"]]
    answerable = [p for p in pairs if items[p.prompt].meta["answerable"]]
    assert 0.2 < len(unanswerable) / len(pairs) < 0.3  # the task's unanswerable_share, 0.25
    assert all(p.chosen == REFUSAL for p in unanswerable)
    assert all(p.chosen == items[p.prompt].meta["answer"] for p in answerable)
    rejected = [p.rejected for p in answerable]
    numbers = sum(is_integer(r) for r in rejected) / len(rejected)
    assert 0.55 < numbers < 0.8  # plausible wrong numbers and other numbers
    assert REFUSAL in rejected and "" in rejected  # refusals and junk, e.g. the empty completion
    assert any(REFUSAL.startswith(r) and 0 < len(r) < len(REFUSAL) for p in pairs for r in [p.rejected])


def test_refusal_pairs_prefer_refusing_exactly_the_unanswerable(task):
    items = _sides(task)[TRAIN]
    pairs = refusal_pairs(task, random.Random(2), 1000)
    for p in pairs:
        if items[p.prompt].meta["answerable"]:
            assert p.rejected == REFUSAL and is_integer(p.chosen)
        else:
            assert p.chosen == REFUSAL and p.rejected != REFUSAL
    share = sum(not items[p.prompt].meta["answerable"] for p in pairs) / len(pairs)
    assert share == 0.5
    wrong_attempts = [p for p in pairs if items[p.prompt].meta["answerable"]
                      and p.chosen != items[p.prompt].meta["answer"]]
    assert 0.2 < len(wrong_attempts) / 500 < 0.4  # attempting is right even when the answer is wrong
