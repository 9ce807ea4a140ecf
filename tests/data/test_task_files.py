"""`grpolab data`: the built-in task as files keeps its split and the loaders read every file."""

from __future__ import annotations

import json

from grpolab import config as C
from grpolab.data.export import export_builtin
from grpolab.data.preferences import load_pairs
from grpolab.data.sft_pairs import load_sft_pairs
from grpolab.data.sources import load_jsonl


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_export_keeps_the_split_and_loads(tmp_path):
    cfg = C.from_preset("grpo", ["sft.examples=300", "sft.refusal_examples=10", "data.eval_prompts=64"])
    files = export_builtin(cfg, tmp_path, prompts=200, pairs=120, heldout_pairs=40)
    heldout = {r["prompt"] for r in _rows(files["heldout"])}
    assert len(heldout) == 64
    train_prompts = {r["prompt"] for r in _rows(files["prompts"])} | {r["prompt"] for r in _rows(files["sft"])}
    train_prompts |= {r["prompt"] for r in _rows(files["accuracy_pairs"]) + _rows(files["refusal_pairs"])}
    assert not heldout & train_prompts  # nothing held out is trained on
    held_pairs = {r["prompt"] for r in _rows(files["accuracy_pairs_heldout"]) + _rows(files["refusal_pairs_heldout"])}
    assert not held_pairs & train_prompts
    assert len(_rows(files["prompts"])) == 200 and len(_rows(files["sft"])) == 300
    for kind in ("accuracy", "refusal"):
        assert len(load_pairs(str(files[f"{kind}_pairs"]))) == 120  # no empty completion: the loader takes them all
        assert len(load_pairs(str(files[f"{kind}_pairs_heldout"]))) == 40
    items = load_jsonl(str(files["prompts"]))
    assert {"answer", "answerable", "op"} <= set(items[0].meta)  # what the rule rewards read
    assert len(load_sft_pairs(f"jsonl:{files['sft']}")) == 300
