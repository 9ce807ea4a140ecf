"""Every error reaches the user as one message naming the field, file, line or path: a table of bad
inputs driven through the command line (exit code 2, no traceback), and property tests throwing
random malformed configs and data files at the loaders (only the named error types come out)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpolab import cli, config as C
from grpolab.data.sources import load_jsonl
from grpolab.models.tiny import build_char_tokenizer

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=4", "train.minibatch_size=4", "train.microbatch_size=2",
        "train.steps=1", "run.progress=false", "run.tensorboard=false"]


def _write(t: Path, name: str, text: str) -> str:
    (t / name).write_text(text)
    return str(t / name)


def _finished_run(t: Path) -> str:
    assert cli.main(["train", "grpo", *TINY, f"run.out_dir={t / 'done'}"]) == 0
    return str(t / "done")


# (id, argv builder, parts the one message must contain)
CASES = [
    ("missing config file", lambda t: ["train", str(t / "nope.yaml")], ["nope.yaml"]),
    ("unknown field in yaml", lambda t: ["train", _write(t, "c.yaml", "preset: grpo\ntrain:\n  stpes: 3\n")],
     ["c.yaml:3", "train.stpes"]),
    ("bad override value", lambda t: ["train", "grpo", "train.lr=fast"], ["train.lr"]),
    ("missing prompt file", lambda t: ["train", "grpo", *TINY, f"data.source=jsonl:{t}/none.jsonl",
                                       f"run.out_dir={t}/r"], ["none.jsonl"]),
    ("prompt line not JSON", lambda t: ["train", "grpo", *TINY, "data.source=jsonl:" + _write(
        t, "p.jsonl", '{"prompt": "1+1="}\n{"prompt": \n'), f"run.out_dir={t}/r"], ["p.jsonl:2", "not valid JSON"]),
    ("prompt the tokenizer cannot encode", lambda t: ["train", "grpo", *TINY, "data.source=jsonl:" + _write(
        t, "u.jsonl", '{"prompt": "1+1="}\n{"prompt": "h\\u00e9llo 1+1="}\n'), f"run.out_dir={t}/r"],
     ["u.jsonl:2", "tokenizer cannot encode"]),
    ("a file that is not GGUF", lambda t: ["train", "grpo", "model.name_or_path=" + _write(t, "m.gguf", "garbage"),
                                           f"run.out_dir={t}/r"], ["m.gguf", "not a GGUF file"]),
    ("missing model folder", lambda t: ["train", "grpo", f"model.name_or_path={t}/no-model", f"run.out_dir={t}/r"],
     ["no-model"]),
    ("unknown reward", lambda t: ["train", "grpo", *TINY, "rewards=[no_such_reward:1.0]"], ["no_such_reward"]),
    ("reward module missing", lambda t: ["train", _write(t, "r.yaml", 'preset: grpo\nrewards: [{name: "nomod:fn"}]\n')],
     ["nomod"]),
    ("resume without a folder", lambda t: ["train", "grpo", "--resume"], ["run.out_dir"]),
    ("train over a finished run", lambda t: ["train", "grpo", *TINY, f"run.out_dir={_finished_run(t)}"],
     ["already holds a finished train run", "--overwrite"]),
    ("report of a missing folder", lambda t: ["report", str(t / "nowhere")], ["nowhere", "does not exist"]),
    ("report of a bad metrics line", lambda t: ["report", str(t)] if _write(
        t, "metrics.jsonl", '{"step": 0}\n{"step": 1, "x": \n{"step": 2}\n') else [], ["metrics.jsonl:2"]),
    ("export of a folder that is not a run", lambda t: ["export", str(t), "--out", str(t / "x")],
     ["not a grpolab run directory"]),
    ("sft pairs without a response", lambda t: ["sft", "sft", *TINY, "data.source=jsonl:" + _write(
        t, "s.jsonl", '{"prompt": "1+1="}\n'), f"run.out_dir={t}/s"], ["s.jsonl:1", "response"]),
    ("config of a missing file", lambda t: ["config", str(t / "missing.yaml")], ["missing.yaml"]),
]


@pytest.mark.parametrize("argv,expected", [pytest.param(a, e, id=i) for i, a, e in CASES])
def test_bad_input_through_the_cli_is_one_message(argv, expected, tmp_path, capsys):
    args = argv(tmp_path)
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    message = [line for line in err.splitlines() if line.startswith("grpolab")]
    assert len(message) == 1, err
    for part in expected:
        assert part in message[0], f"{part!r} not in: {message[0]}"


def test_report_of_a_killed_run_leaves_out_its_cut_last_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n{"step": 1, "reward/me')
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").is_file()


# ---------------------------------------------------------------------- property tests
FIELDS = ["preset", "train", "train.steps", "rollout", "rollout.group_size", "loss.kl_coef", "rewards", "data.source",
          "model", "run.out_dir", "stpes", "loss.loss_agg"]
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True)
                      | st.text(string.printable, max_size=12),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=3),
                      max_leaves=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4) | st.text(string.printable, max_size=60))
def test_random_configs_give_config_errors_only(doc, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    try:
        C.load(str(path))
    except C.ConfigError as e:
        assert str(e)
    except ValueError as e:  # e.g. a preset's validation: still one message naming the field
        assert str(e) and "Traceback" not in str(e)


ROWS = st.dictionaries(st.sampled_from(["prompt", "messages", "answer", "x"]), VALUES, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(ROWS.map(json.dumps) | st.text(string.printable, max_size=40), min_size=1, max_size=5))
def test_random_prompt_files_give_errors_naming_the_file_and_line(lines, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    try:
        items = load_jsonl(path, tokenizer=build_char_tokenizer(), use_chat_template=False)
    except ValueError as e:
        assert str(path) in str(e)
    else:
        assert all(isinstance(it.prompt, str) and it.prompt for it in items)
