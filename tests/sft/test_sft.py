"""SFT on the built-in task (`grpolab sft`, the demo's π0): the sft.* settings all take effect."""

import json

from grpolab import cli, config as C
from grpolab.data.build import arith_task
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.sft.sft import sft_builtin

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "sft.steps=6", "sft.batch_size=8",
         "sft.microbatch_size=4", "sft.examples=64", "sft.refusal_examples=8", "sft.probe_prompts=4",
         "sft.probe_every=2", "data.arith_ops=+-", "run.progress=false", "run.tensorboard=false"]


def _run(*ov):
    cfg = C.from_preset("sft", SMALL + list(ov))
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    lines = []
    return sft_builtin(model, tok, arith_task(cfg), cfg, say=lines.append), lines


def test_stop_at_accuracy_probes_every_n_steps_and_stops(monkeypatch):
    losses, lines = _run("sft.stop_at_accuracy=0.0")
    assert len(losses) == 6 and not any("probe" in line for line in lines)
    seen, accs = [], iter([0.1, 0.5, 0.9])

    def fake_eval(model, engine, items, **kw):
        seen.append([it.prompt for it in items])
        return {"accuracy": next(accs)}

    monkeypatch.setattr("grpolab.evaluation.evaluate.evaluate_arith", fake_eval)
    losses, lines = _run("sft.stop_at_accuracy=0.4")
    assert len(losses) == 4  # probed after steps 2 (0.1) and 4 (0.5 >= 0.4): stopped
    assert [line.split(":")[0] for line in lines if "probe" in line] == ["[sft] step 2", "[sft] step 4"]
    task = arith_task(C.from_preset("sft", SMALL))
    train_side = {it.prompt for it in task.items("train")}
    assert len(seen[0]) == 4 and set(seen[0]) <= train_side  # sft.probe_prompts, training side only


def test_grpolab_sft_on_the_builtin_task_uses_the_same_trainer(tmp_path, capsys):
    code = cli.main(["sft", "sft", *SMALL, f"run.out_dir={tmp_path}", "sft.refusal_kinds=[missing_operand]"])
    assert code == 0
    err = capsys.readouterr()
    assert "64 examples (8 refusals)" in err.out + err.err
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert json.loads(json.dumps(C.load(str(tmp_path / "config.yaml")).sft.refusal_kinds)) == ["missing_operand"]


def test_sft_on_a_data_file_computes_in_the_models_dtype(tmp_path, monkeypatch):
    """model.dtype reaches `grpolab sft` on a data file as GRPO's forward gets it: bfloat16 is autocast, float32
    is plain (the master weights stay float32 either way)."""
    import torch

    import grpolab.sft.sft as sft

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(8)))
    seen, train = [], sft.train_sft
    monkeypatch.setattr(sft, "train_sft", lambda *a, **k: seen.append(k["compute_dtype"]) or train(*a, **k))
    for dtype in ("bfloat16", "float32"):
        out = tmp_path / dtype
        assert cli.main(["sft", "sft", *SMALL, "sft.steps=1", f"data.source=jsonl:{data}", f"model.dtype={dtype}",
                         f"run.out_dir={out}"]) == 0
        assert (out / "final" / "config.json").is_file()
    assert seen == [torch.bfloat16, None]
