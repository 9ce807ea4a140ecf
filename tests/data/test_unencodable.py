"""Data the model's tokenizer cannot encode (here: characters outside the built-in character tokenizer's
alphabet) is found when the data loads, before any training step, with one message naming FILE:LINE,
the field and the character: SFT pairs (a response, a prompt, a chat reply), GRPO prompts (plain and
chat), reward-model pairs (prompt, chosen, rejected), JSONL and local datasets alike."""

from __future__ import annotations

import json

import pytest

from grpolab import cli
from grpolab.models.tiny import build_char_tokenizer

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "run.progress=false",
        "run.tensorboard=false", "run.threads=1"]
GRPO = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=1",
        "train.minibatch_size=4", "train.microbatch_size=4"]


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Every check must fire before the first training step (SFT, GRPO generation, RM training)."""
    from grpolab.reward_models import training
    from grpolab.rollout.hf import HFEngine
    from grpolab.sft import sft

    def fail(*a, **k):
        raise AssertionError("training started before the data was checked")

    monkeypatch.setattr(sft, "train_sft", fail)
    monkeypatch.setattr(HFEngine, "generate", fail)
    monkeypatch.setattr(training, "train_reward_model", fail)


def _jsonl(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refused(argv, capsys, *expected):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in expected:
        assert text in err, (text, err)


@pytest.mark.parametrize("row,field,char", [
    ({"prompt": "1+1=", "response": "2 é"}, "the response", "'é' (U+00E9)"),
    ({"prompt": "1+1=Ω", "response": "2"}, "the prompt", "'Ω' (U+03A9)"),
    ({"prompt": "1+1=", "response": "two\ttabs"}, "the response", "'\\t' (U+0009)"),
    ({"prompt": "ONE+1=", "response": "2"}, "the prompt", "'O' (U+004F)"),  # upper case is outside a-z
])
def test_sft_data(row, field, char, tmp_path, capsys):
    data = _jsonl(tmp_path / "sft.jsonl", {"prompt": "2+2=", "response": "4"}, row)
    _refused(["sft", *TINY, "sft.steps=2", f"data.source=jsonl:{data}", f"run.out_dir={tmp_path / 'run'}"],
             capsys, f"{data}:2: {field}", char)


def test_grpo_prompts(tmp_path, capsys):
    data = _jsonl(tmp_path / "prompts.jsonl", {"prompt": "1+1="}, {"prompt": "2+2="}, {"prompt": "3+3=€"})
    _refused(["train", "grpo", *TINY, *GRPO, f"data.source=jsonl:{data}", f"run.out_dir={tmp_path / 'run'}"],
             capsys, f"{data}:3: the prompt", "'€' (U+20AC)")


@pytest.mark.parametrize("row,field", [
    ({"prompt": "1+1=", "chosen": "2", "rejected": "3é"}, "field 'rejected'"),
    ({"prompt": "1+1=", "chosen": "2é", "rejected": "3"}, "field 'chosen'"),
    ({"prompt": "1+1é", "chosen": "2", "rejected": "3"}, "the prompt"),
])
def test_reward_model_pairs(row, field, tmp_path, capsys):
    data = _jsonl(tmp_path / "pairs.jsonl", {"prompt": "2+2=", "chosen": "4", "rejected": "5"}, row)
    _refused(["rm", "--data", str(data), "--out", str(tmp_path / "rm"), "--steps", "2"], capsys,
             f"{data}:2: {field}", "'é' (U+00E9)")


def test_held_out_pairs_too(tmp_path, capsys):
    good = _jsonl(tmp_path / "pairs.jsonl", {"prompt": "2+2=", "chosen": "4", "rejected": "5"})
    bad = _jsonl(tmp_path / "heldout.jsonl", {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
                 {"prompt": "1+1=", "chosen": "2", "rejected": "3\u00a0"})
    _refused(["rm", "--data", str(good), "--eval-data", str(bad), "--out", str(tmp_path / "rm"), "--steps", "2"],
             capsys, f"{bad}:2: field 'rejected'", "U+00A0")


def test_chat_rows_with_the_chat_tokenizer(tmp_path):
    """The chat replies of SFT rows and chat prompts are checked after the template renders them."""
    from grpolab.data.sft_pairs import load_sft_pairs
    from grpolab.data.sources import load_jsonl
    from grpolab.models.tiny_chat import build_char_chat_tokenizer

    tok = build_char_chat_tokenizer()
    data = _jsonl(tmp_path / "chat.jsonl", {"messages": [{"role": "user", "content": "1+1="},
                                                          {"role": "assistant", "content": "2 ü"}]})
    with pytest.raises(ValueError, match=f"{data}:1: the response.*'ü' \\(U\\+00FC\\)"):
        load_sft_pairs(f"jsonl:{data}", tokenizer=tok)
    prompts = _jsonl(tmp_path / "p.jsonl", {"prompt": "1+1="}, {"messages": [{"role": "user", "content": "ü"}]})
    with pytest.raises(ValueError, match=f"{prompts}:2: the prompt.*'ü'"):
        load_jsonl(prompts, tokenizer=tok)


def test_encode_text_names_the_first_character_and_passes_what_encodes():
    from grpolab.data.sources import encode_text

    tok = build_char_tokenizer()
    assert encode_text(tok, "12+7=cannot", "x") == tok("12+7=cannot", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=r"^f.jsonl:4: the prompt: .*'é' \(U\+00E9\) at position 3"):
        encode_text(tok, "abcéü", "f.jsonl:4: the prompt")
    extra = build_char_tokenizer(extra_chars="é")
    assert len(encode_text(extra, "abcé", "x")) == 4
