"""`grpolab ablate`: a tiny ablation end to end (run directories, ablate.json / ablate.html, equal
budgets, finished runs skipped), each variant's config, and the summary computed from the numbers."""

from __future__ import annotations

import argparse
import json
import math
from html import escape

import pytest

from grpolab.app import ablate as A
from grpolab.cli import ablate as cli_ablate
from grpolab import config as C
from grpolab.report import ablate as R
from grpolab.report.metrics import read_metrics

TINY = ("model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "sft.steps=40", "sft.stop_at_accuracy=0",
        "sft.examples=300", "sft.refusal_examples=20", "data.eval_prompts=32", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=6")


def tiny(out, variants, seeds=(0, 1), steps=2, **kw) -> A.Ablation:
    return A.Ablation(out=out, variants=tuple(variants), seeds=tuple(seeds), steps=steps, overrides=TINY, jobs=1,
                      threads=0, **kw)


@pytest.mark.slow
def test_tiny_ablation_writes_the_table_and_skips_finished_runs(tmp_path, capsys, monkeypatch):
    ab = tiny(tmp_path, ["reinforce", "grpo"])
    assert ab.budget == 4 * 4 * 2
    said: list[str] = []
    data = A.run_ablation(ab, say=said.append)
    assert data["failed"] == []
    rows = {r["variant"]: r for r in data["table"]}
    assert list(rows) == ["pi0", "reinforce", "grpo"]
    for v in ("reinforce", "grpo"):
        assert rows[v]["seeds"] == [0, 1]
        for s in (0, 1):
            run = data["runs"][f"{v}-seed{s}"]
            assert run["completions"] == ab.budget and run["steps"] == 2  # equal budgets
            assert run["before"] == data["pi0"][str(s)]["pi0"]  # every variant of a seed starts from its π0
            assert run["after"] == {k: run["curve"][-1][k] for k in R.METRICS}
            assert [c["completions"] for c in run["curve"]][0] == 0
            d = tmp_path / f"{v}-seed{s}"
            assert [r["step"] for r in read_metrics(d / "metrics.jsonl")] == [0, 1]
            assert (d / "final" / "config.json").is_file() and not (d / "checkpoints").exists()
            assert C.load(str(d / "config.yaml")).model.name_or_path == str(tmp_path / f"pi0-seed{s}" / "pi0")
        gains = [data["runs"][f"{v}-seed{s}"]["after"]["accuracy"] - data["pi0"][str(s)]["pi0"]["accuracy"]
                 for s in (0, 1)]
        assert rows[v]["gain"]["values"] == pytest.approx(gains)
    # each preset keeps its Phase B: grpo two minibatches per rollout (64 of 128 by default), reinforce one
    assert data["runs"]["grpo-seed0"]["optimizer_steps_per_step"] == 2
    assert data["runs"]["reinforce-seed0"]["optimizer_steps_per_step"] == 1
    assert json.loads((tmp_path / "ablate.json").read_text())["table"] == R.jsonable(data["table"])
    page = (tmp_path / "ablate.html").read_text()
    assert 'id="ablate-table"' in page and "data:image/png;base64," in page and escape(data["summary"][0]) in page
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "reinforce" in out and data["summary"][0] in out

    # Again: nothing is trained (the workers would raise), nothing is rewritten.
    stamp = (tmp_path / "grpo-seed1" / "eval.json").stat().st_mtime_ns
    monkeypatch.setattr(A, "run_variant", lambda *a: pytest.fail("a finished run was run again"))
    monkeypatch.setattr(A, "build_pi0", lambda *a: pytest.fail("a finished π0 was built again"))
    said.clear()
    again = A.run_ablation(ab, say=said.append)
    assert again["failed"] == [] and again["table"] == data["table"] and again["reused_runs"] == 4
    assert any("4 finished run(s)" in m for m in said)
    assert (tmp_path / "grpo-seed1" / "eval.json").stat().st_mtime_ns == stamp
    # Other settings in the same folder: refused before any work, naming --out.
    with pytest.raises(ValueError, match="--out.*train.steps"):
        A.run_ablation(tiny(tmp_path, ["reinforce", "grpo"], steps=3), say=said.append)


@pytest.mark.slow
def test_budget_is_equal_for_dapo_and_the_sharpening_variants(tmp_path):
    ab = tiny(tmp_path, ["dapo", "rl_sharpening", "sft_sharpening"], seeds=(0,), steps=3)
    data = A.run_ablation(ab, say=lambda m: None)
    assert data["failed"] == []
    runs = {p["variant"]: p for p in data["runs"].values()}
    assert runs["rl_sharpening"]["completions"] == runs["sft_sharpening"]["completions"] == ab.budget == 48
    # dynamic sampling draws extra batches: the run stops after the step that reaches the budget
    dapo, cfg = runs["dapo"], ab.variant_config("dapo", 0)
    assert ab.budget <= dapo["completions"] < ab.budget + cfg.rollout.max_generation_batches * cfg.sequences_per_step
    assert dapo["steps"] <= 3 and len(read_metrics(tmp_path / "dapo-seed0" / "metrics.jsonl")) == dapo["steps"]
    assert C.load(str(tmp_path / "rl_sharpening-seed0" / "config.yaml")).rewards[0].name == "self_likelihood"
    assert runs["sft_sharpening"]["sft"]["pairs"] >= 1 and (tmp_path / "sft_sharpening-seed0" / "final").is_dir()
    assert all(p["tokens"] > 0 for p in runs.values())


def test_variant_configs_share_the_sizes_and_keep_each_presets_phase_b(tmp_path):
    ab = A.Ablation(out=tmp_path, variants=A.DEFAULT_VARIANTS[:3], seeds=(0,), steps=100)
    for v in [p for p in C.PRESETS if p != "sft"] + list(A.SHARPENING):
        cfg, own = ab.variant_config(v, 0), C.from_preset(A.preset_of(v))
        assert cfg.sequences_per_step * cfg.train.steps == ab.budget == 16 * 8 * 100, v
        assert (cfg.train.lr, cfg.train.lr_schedule, cfg.rollout.max_new_tokens) == (1e-4, "constant", 8), v
        assert (cfg.train.epochs, cfg.minibatches_per_epoch) == (own.train.epochs, own.minibatches_per_epoch), v
        assert cfg.loss == own.loss, v
    assert ab.variant_config("sft_o1", 0).train.steps == 200  # half the prompts per step, twice the steps
    # at another step size a preset keeps its minibatch count: grpo's 2 per epoch of 4 × 4 = 16 sequences
    small = A.Ablation(out=tmp_path, variants=("grpo",), seeds=(0,), steps=2, overrides=TINY)
    assert small.variant_config("grpo", 0).train.minibatch_size == 8
    odd = A.Ablation(out=tmp_path, variants=("grpo",), seeds=(0,), steps=2,
                     overrides=("rollout.prompts_per_step=3", "rollout.group_size=1"))
    with pytest.raises(ValueError, match="rollout.prompts_per_step"):
        odd.variant_config("grpo", 0)


def test_bad_settings_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--presets: unknown variant 'nope'"):
        A.Ablation(out=tmp_path, variants=("nope",), seeds=(0,))
    with pytest.raises(ValueError, match="--presets: sft"):
        A.Ablation(out=tmp_path, variants=("sft",), seeds=(0,))
    with pytest.raises(ValueError, match="train.seed"):
        A.Ablation(out=tmp_path, variants=("grpo",), seeds=(0,), overrides=("train.seed=3",))
    with pytest.raises(ValueError, match="--steps"):
        A.Ablation(out=tmp_path, variants=("grpo",), seeds=(0,), steps=0)


def test_three_level_reward_levels():
    ans = {"answerable": True, "answer": "21", "truncated": False}
    una = {"answerable": False, "answer": None, "truncated": False}
    rows = [("21", ans, 1.0), ("12", ans, -1.0), ("cannot", ans, -2.0), ("2x", ans, -2.0),
            ("21", {**ans, "truncated": True}, -2.0), ("cannot", una, 1.0), ("5", una, -1.0), ("", una, -2.0)]
    texts, metas, want = zip(*rows)
    assert A.three_level_reward([""] * len(rows), list(texts), list(metas)) == list(want)


def _parse(argv):
    p = argparse.ArgumentParser()
    cli_ablate.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["ablate", *argv])


def test_cli_flags(tmp_path, monkeypatch, capsys):
    args = _parse(["--presets", "reinforce,grpo", "--seeds", "0,2", "--steps", "7", "--out", str(tmp_path),
                   "--jobs", "1", "train.lr=5e-5"])
    ab = cli_ablate.ablation(args)
    assert (ab.variants, ab.seeds, ab.steps, ab.overrides, ab.jobs, ab.threads) == (
        ("reinforce", "grpo"), (0, 2), 7, ("train.lr=5e-5",), 1, 0)
    assert ab.variant_config("grpo", 2).train.lr == 5e-5
    quick = cli_ablate.ablation(_parse(["--quick"]))
    assert (quick.steps, quick.seeds, quick.threads) == (A.QUICK_STEPS, (0, 1), 1)
    # ppo is in the defaults when this grpolab has the preset, else left out with a note
    monkeypatch.setitem(C.PRESETS, "ppo", C.PRESETS.get("ppo", {}))
    assert "ppo" in cli_ablate.ablation(_parse([])).variants
    monkeypatch.delitem(C.PRESETS, "ppo")
    notes: list[str] = []
    assert "ppo" not in cli_ablate.ablation(_parse([]), say=notes.append).variants
    assert any("ppo" in n for n in notes)
    assert cli_ablate.run(_parse(["--presets", "grpo,nope", "--out", str(tmp_path)])) == 2
    assert "--presets: unknown variant 'nope'" in capsys.readouterr().err
    assert cli_ablate.run(_parse(["--seeds", "0,x", "--out", str(tmp_path)])) == 2
    assert "--seeds" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the computed summary


def _payloads(acc: dict[str, list[float]], pi0: float = 0.3) -> dict[str, dict]:
    """Synthetic eval.json payloads: variant -> held-out accuracy per seed."""
    runs = {}
    for v, values in acc.items():
        for s, a in enumerate(values):
            runs[f"{v}-seed{s}"] = {"variant": v, "seed": s, "before": {"accuracy": pi0},
                                    "after": {"accuracy": a, "refusal_recall": 0.5, "false_refusal": 0.0},
                                    "wall_s": 10.0, "completions": 100, "tokens": 300.0, "steps": 5,
                                    "optimizer_steps_per_step": 1}
    return runs


def _summary(acc: dict[str, list[float]]) -> list[str]:
    pi0 = {s: {"pi0": {"accuracy": 0.3, "refusal_recall": 0.5, "false_refusal": 0.0}, "wall_s": 5.0}
           for s in range(3)}
    return R.ablation_data({"variants": list(acc)}, pi0, _payloads(acc), wall_s=1.0)["summary"]


def _line(lines: list[str], start: str) -> str:
    return next(line for line in lines if line.startswith(start))


def test_summary_reports_changes_beyond_the_seed_spread_only():
    acc = {"onpolicy_sft": [0.40, 0.42, 0.44], "reinforce": [0.60, 0.62, 0.64],  # +0.20, sd 0.02: 10 sd
           "reinforce_norm": [0.58, 0.64, 0.70],  # +0.02, pooled sd 0.045: within
           "grpo_no_kl": [0.50, 0.52, 0.54],  # −0.12, pooled sd 0.045: 2.7 sd, beyond (hurts)
           "grpo": [0.49, 0.55, 0.52], "dapo": [0.70, 0.71, 0.72]}
    lines = _summary(acc)
    assert "+0.200 (10.0 pooled sd: beyond the seed spread)" in _line(lines, "- negative gradient")
    assert "+0.020 (0.4 pooled sd: within the seed spread)" in _line(lines, "- reward normalization")
    assert "-0.120 (2.7 pooled sd: beyond" in _line(lines, "- importance sampling + clipping")
    assert "within the seed spread" in _line(lines, "- KL penalty")
    verdict = _line(lines, "The SFT-to-GRPO spectrum")
    assert ("negative gradient helps (agrees); reward normalization no change beyond the seed spread (disagrees); "
            "importance sampling + clipping, with several updates per rollout hurts (agrees); KL penalty no change "
            "beyond the seed spread (agrees): 3 of 4 agree") in verdict
    assert "beyond the seed spread" in _line(lines, "- dapo vs grpo")
    assert _line(lines, "Highest held-out accuracy").startswith("Highest held-out accuracy: dapo 0.710 ± 0.010")
    assert "0.010 to 0.060 (median 0.020); mean gains over π0 range from +0.120 to +0.410" in _line(lines, "Seed spread")
    # the same table with the negative gradient's effect inside the noise: the verdict follows the numbers
    acc["reinforce"] = [0.38, 0.43, 0.48]
    lines = _summary(acc)
    assert "within the seed spread" in _line(lines, "- negative gradient")
    assert "negative gradient no change beyond the seed spread (disagrees)" in _line(lines, "The SFT-to-GRPO spectrum")


def test_summary_with_grpo_no_is_splits_the_third_step():
    acc = {v: [0.5, 0.52, 0.54] for v in R.DIAL_VARIANTS}
    lines = _summary(acc)
    assert _line(lines, "- several updates per rollout, uncorrected (reinforce_norm → grpo_no_is)")
    assert _line(lines, "- importance sampling + clipping (grpo_no_is → grpo_no_kl)")
    # equal means: the tricks the spectrum calls essential disagree, the droppable ones agree; the extra
    # updates are no trick of the spectrum's and are not counted
    assert _line(lines, "The SFT-to-GRPO spectrum").endswith("2 of 4 agree.")


def test_compare_edge_cases():
    one = {"accuracy": R.stat([0.5])}
    assert R.compare(one, {"accuracy": R.stat([0.9])})["verdict"] == "n/a"
    flat_a, flat_b = {"accuracy": R.stat([0.5, 0.5])}, {"accuracy": R.stat([0.6, 0.6])}
    assert R.compare(flat_a, flat_b) == {"delta": pytest.approx(0.1), "pooled_sd": 0.0, "ratio": math.inf,
                                         "verdict": "beyond"}
    assert R.compare(flat_a, flat_a)["verdict"] == "within"
    s = R.stat([1.0, 2.0, 3.0])
    assert (s["mean"], s["sd"], s["min"], s["max"]) == (2.0, 1.0, 1.0, 3.0)


# ----------------------------------------------------------------------------- OUT is claimed like a run folder

SMALL = ["--presets", "grpo", "--seeds", "0", "--steps", "1", "--jobs", "1", "model.hidden_size=32",
         "model.num_layers=1", "model.num_heads=2", "sft.steps=2", "sft.stop_at_accuracy=0", "sft.examples=50",
         "sft.refusal_examples=5", "data.eval_prompts=8", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4"]


def test_ablate_never_writes_over_the_users_files(tmp_path, capsys):
    from grpolab import cli

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my own\n")
    assert cli.main(["ablate", "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"--out='{out}' holds files grpolab did not write (notes.txt)" in err and "--overwrite" in err
    assert "Traceback" not in err and sorted(p.name for p in out.iterdir()) == [".grpolab.lock", "notes.txt"]
    assert (out / "notes.txt").read_text() == "my own\n"
    assert cli.main(["ablate", "--out", str(out), *SMALL, "--overwrite"]) == 0
    moved, = tmp_path.glob("mine.old-*")
    assert (moved / "notes.txt").read_text() == "my own\n" and not (out / "notes.txt").exists()
    assert (out / "ablate.json").is_file()
    capsys.readouterr()
    assert cli.main(["ablate", "--out", str(out), *SMALL]) == 0  # its own folder: continued, runs reused
    assert "1 finished run(s) found" in capsys.readouterr().err


def test_ablate_refuses_a_folder_holding_another_commands_run(tmp_path, capsys):
    from grpolab import cli

    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"command": "train", "status": "finished"}))
    assert cli.main(["ablate", "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "holds a finished train run, which `grpolab ablate` cannot continue" in err
    assert sorted(p.name for p in out.iterdir()) == [".grpolab.lock", "final", "run.json"]
