import json

import pytest

from grpolab.data.arith import PromptItem
from grpolab.data.sources import load_hf_dataset, load_jsonl, reasoning_gym_items


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_plain_prompts_keep_other_fields_in_meta(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+3=", "answer": "5", "id": 7}, "", {"prompt": "1+1="}])
    items = load_jsonl(f)
    assert items == [PromptItem("2+3=", {"answer": "5", "id": 7}), PromptItem("1+1=", {})]


def test_jsonl_chat_template_and_system_prompt(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2+3?", "answer": "5"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]},
    ])
    default = load_jsonl(f, tokenizer=tok)
    assert default[0].prompt == ("<|im_start|>system\nDEFAULT SYSTEM<|im_end|>\n"
                                 "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert default[0].meta == {"answer": "5"}
    assert "DEFAULT SYSTEM" in default[1].prompt

    empty = load_jsonl(f, tokenizer=tok, system_prompt="")
    assert empty[0].prompt.startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n2+3?")
    assert all("DEFAULT" not in it.prompt for it in empty)
    # a row's own system message wins over the configured one
    assert "<|im_start|>system\nown<|im_end|>" in empty[2].prompt and empty[2].prompt.count("system") == 1

    # without the template a prompt is used as is, and chat messages are an error
    with pytest.raises(ValueError, match=r"p\.jsonl:2: has chat messages but no tokenizer with a chat template"):
        load_jsonl(f, tokenizer=tok, use_chat_template=False)
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"q": "2+3?"}])
    assert load_jsonl(plain, tokenizer=tok, use_chat_template=False, prompt_field="q")[0].prompt == "2+3?"


@pytest.mark.parametrize("rows, match", [
    (['{"prompt": "a"}', '{"prompt": '], r"p\.jsonl:2: not valid JSON"),
    (['{"prompt": "a"}', '["a"]'], r"p\.jsonl:2: expected a JSON object"),
    (['{"question": "a"}'], r"p\.jsonl:1: needs exactly one of the fields 'prompt' or 'messages', has neither"),
    (['{"prompt": "a", "messages": []}'], r"p\.jsonl:1: .* has both"),
    (['{"prompt": "   "}'], r"p\.jsonl:1: field 'prompt' is empty"),
    (['{"prompt": 3}'], r"p\.jsonl:1: field 'prompt' must be a string"),
    (['{"messages": [{"role": "user"}]}'], r"p\.jsonl:1: message 0 must be an object"),
    (['{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'],
     r"p\.jsonl:1: the last message is the assistant's"),
    (['{"messages": [{"role": "user", "content": "q"}]}'], r"p\.jsonl:1: has chat messages but no tokenizer"),
    ([""], r"p\.jsonl: no prompts"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, rows, match):
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        load_jsonl(f)


def test_jsonl_missing_file_and_max_tokens(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    fits = write_jsonl(tmp_path / "fits.jsonl", [{"prompt": "short"}, {"prompt": "x" * 40}])
    assert len(load_jsonl(fits, tokenizer=tok, use_chat_template=False, max_prompt_tokens=40)) == 2
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "short"}, {"prompt": "x" * 41}])
    too_long = r"long\.jsonl:2: the prompt is 41 tokens long, more than max_prompt_tokens=40"
    with pytest.raises(ValueError, match=too_long):
        load_jsonl(long, tokenizer=tok, use_chat_template=False, max_prompt_tokens=40)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_jsonl(fits, max_prompt_tokens=10)


def test_hf_dataset_local_files(tmp_path, tok):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (grpolab[tasks])")
    rows = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "4-1=", "answer": "3"}]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    cache = str(tmp_path / "hf_cache")
    expected = load_jsonl(f, tokenizer=tok, system_prompt="")
    assert load_hf_dataset(f, tokenizer=tok, system_prompt="", cache_dir=cache) == expected

    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    assert load_hf_dataset(tmp_path / "p.parquet", cache_dir=cache) == load_jsonl(f)

    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved"))
    assert load_hf_dataset(tmp_path / "saved", "test") == load_jsonl(f)
    with pytest.raises(ValueError, match="no split 'train'"):
        load_hf_dataset(tmp_path / "saved")
    with pytest.raises(FileNotFoundError, match="not found locally"):
        load_hf_dataset(tmp_path / "org/name")
    bad = datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": ""}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"bad\[train\] row 1: field 'prompt' is empty"):
        load_hf_dataset(tmp_path / "bad")


RG = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)


def test_reasoning_gym_items(tok):
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (grpolab[tasks])")
    items = reasoning_gym_items("chain_sum", size=4, seed=3, tokenizer=tok, system_prompt="", **RG)
    assert len(items) == 4
    assert items == reasoning_gym_items("chain_sum", size=4, seed=3, tokenizer=tok, system_prompt="", **RG)
    for it in items:
        entry = it.meta["rg_entry"]
        assert it.prompt == ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n" + entry["question"]
                             + "<|im_end|>\n<|im_start|>assistant\n")
        assert it.meta["answer"] == entry["answer"] and it.meta["rg_task"] == "chain_sum" and it.meta["rg_params"] == RG
        assert entry["metadata"]["num_terms"] == 2
    raw = reasoning_gym_items("chain_sum", size=1, seed=3, **RG)
    assert raw[0].prompt == items[0].meta["rg_entry"]["question"]
    with pytest.raises(ValueError, match="'no_such_task'"):
        reasoning_gym_items("no_such_task", size=1, seed=0)
    with pytest.raises(ValueError, match="chain_sum"):
        reasoning_gym_items("chain_sum", size=1, seed=0, bogus_param=1)
