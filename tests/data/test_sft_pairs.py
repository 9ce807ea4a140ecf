"""grpolab.data.sft_pairs, and `grpolab sft` on a JSONL file: the loss falls and the model learns the targets."""

import json

import pytest

from grpolab.cli import main
from grpolab.data.sft_pairs import load_sft_pairs


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_response_and_chat_rows(tmp_path, tok):
    f = _write(tmp_path / "s.jsonl", [
        {"q": "2+3?", "a": "5", "id": 1},
        "",
        {"chat": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ])
    pairs = load_sft_pairs(f"jsonl:{f}", prompt_field="q", response_field="a", messages_field="chat",
                           tokenizer=tok, system_prompt="")
    assert pairs == [("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n", "5"),
                     ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                      "hello")]
    only_prompts = _write(tmp_path / "p.jsonl", [{"q": "2+3?", "a": "5"}])
    plain = load_sft_pairs(f"jsonl:{only_prompts}", prompt_field="q", response_field="a", tokenizer=tok,
                           use_chat_template=False)
    assert plain == [("2+3?", "5")]


@pytest.mark.parametrize("row, match", [
    ({"prompt": "2+3?"}, r"s\.jsonl:1: has 'prompt' but no 'response'"),
    ({"prompt": "2+3?", "response": ""}, r"s\.jsonl:1: the response must be a non-empty string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"s\.jsonl:1: field 'messages' must end with the assistant"),
    ({"text": "x"}, r"s\.jsonl:1: needs exactly one of the fields 'prompt' or 'messages'"),
    ("[1, 2]", r"s\.jsonl:1: expected a JSON object"),
    ("{oops", r"s\.jsonl:1: not valid JSON"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, row, match):
    f = _write(tmp_path / "s.jsonl", [row])
    with pytest.raises(ValueError, match=match):
        load_sft_pairs(f"jsonl:{f}")


def test_grpolab_sft_on_a_jsonl_file_learns_its_pairs(tmp_path, capsys):
    from grpolab.models.loading import load_model
    from grpolab.rollout.hf import HFEngine

    targets = {"12+7=": "19", "30-4=": "26", "5+5=": "10", "41+2=": "43"}
    data = _write(tmp_path / "pairs.jsonl", [{"prompt": p, "response": r} for p, r in targets.items()])
    out = tmp_path / "run"
    code = main(["sft", "sft", f"data.source=jsonl:{data}", "sft.steps=150", "sft.batch_size=4",
                 "sft.microbatch_size=2", "sft.lr=3e-3", "model.hidden_size=64", "model.num_layers=2",
                 f"run.out_dir={out}", "run.threads=1"])
    assert code == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("[sft] step")]
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in lines]
    assert len(losses) == 11 and losses[-1] < losses[0] / 10, losses  # steps 1, 15, 30, ..., 150
    assert lines[-1].startswith("[sft] step 150/150 loss") and " s/step, elapsed " in lines[-1]
    assert lines[-1].endswith("ETA 0:00") and lines[0].startswith("[sft] step 1/150 loss")
    model, tok = load_model(out / "final")
    ro = HFEngine(tok, max_new_tokens=4).generate_with(model, list(targets), 1, greedy=True)
    texts = HFEngine(tok, max_new_tokens=4).decode(ro)
    assert dict(zip(targets, texts)) == targets


def test_grpolab_sft_with_a_bad_file_is_one_message(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "1+1="}])
    assert main(["sft", "sft", f"data.source=jsonl:{bad}", f"run.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: has 'prompt' but no 'response'" in err and "Traceback" not in err
