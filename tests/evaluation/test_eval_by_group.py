"""`grpolab eval` per metadata value (eval.group_by) and with every held-out completion and its scores in
a JSONL file; held-out rows of data.eval_source are all used unless data.eval_prompts caps them (said)."""

from __future__ import annotations

import json

import pytest

from grpolab import cli, config as C
from grpolab.errors import ConfigError
from grpolab.evaluation.evaluate import eval_items

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.max_new_tokens=4"]
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1], "answerable": True, "kind": "small" if a < 5 else "big",
         "n": a % 2} for a, b in ((1, 2), (3, 4), (6, 1), (7, 2), (8, 8))]
ROWS.append({"prompt": "1/0=", "answer": None, "answerable": False})


@pytest.fixture
def heldout(tmp_path):
    p = tmp_path / "heldout.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return f"data.eval_source=jsonl:{p}"


def test_every_metric_per_value_and_every_completion_in_a_file(model_dir, heldout, tmp_path, capsys):
    out = tmp_path / "res" / "eval.json"
    out.parent.mkdir()
    argv = ["eval", str(model_dir), "grpo", *TINY, heldout, "eval.group_by=[kind, n]", "--samples", "2",
            "--out", str(out)]
    assert cli.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    kind = res["by"]["kind"]
    assert list(kind) == ["small", "big", "null"]  # first-seen order; the row without the field: null
    assert [g["prompts"] for g in kind.values()] == [2, 3, 1] and set(res["by"]["n"]) == {"0", "1", "null"}
    for g in kind.values():
        assert set(g["greedy"]) == set(res["greedy"]) and set(g["sampled"]) == set(res["sampled"])
    records = [json.loads(x) for x in (tmp_path / "res" / "completions.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == [r["prompt"] for r in ROWS]
    assert all(len(r["samples"]) == 2 and set(r["scores"]) == {"exact_match", "refusal"} for r in records)
    small = [r["scores"]["exact_match"] for r in records if r["meta"].get("kind") == "small"]
    assert kind["small"]["greedy"]["reward/exact_match"] == pytest.approx(sum(small) / len(small))
    assert json.loads(out.read_text())["by"] == res["by"] and "completions" not in res


def test_a_group_field_no_row_has_is_named(model_dir, heldout, capsys):
    assert cli.main(["eval", str(model_dir), "grpo", *TINY, heldout, "eval.group_by=topic"]) == 2
    err = capsys.readouterr().err
    assert "eval.group_by: no held-out row has the field 'topic'; their fields: answer, answerable, kind, n" in err


def test_eval_group_by_is_validated():
    with pytest.raises(ConfigError, match="eval.group_by: \\['kind', 'kind'\\] names a field twice"):
        C.from_preset("grpo", ["eval.group_by=[kind, kind]"])
    assert C.from_preset("grpo", ["eval.group_by=kind"]).eval.group_fields == ("kind",)
    agent = ["environment.name=grpolab.agents.builtin:GuessNumber", "data.source=builtin:seeds", "rewards=[]"]
    with pytest.raises(ConfigError, match="eval.group_by: an agent run's episodes are not broken down"):
        C.from_preset("grpo", [*agent, "eval.group_by=kind"])


def test_held_out_rows_are_all_used_unless_capped(heldout, capsys):
    cfg = C.from_preset("grpo", [heldout, "data.chat_template=false"])
    assert len(eval_items(cfg, None)) == len(ROWS) and "note" not in capsys.readouterr().err
    capped = eval_items(cfg.replace(**{"data.eval_prompts": 2}), None)
    assert [it.prompt for it in capped] == ["1+2=", "3+4="]
    assert f"data.eval_prompts=2 keeps the first 2 of the {len(ROWS)} rows" in capsys.readouterr().err
