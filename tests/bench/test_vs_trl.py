"""bench/vs_trl.py's command line."""

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import vs_trl  # noqa: E402


def test_vs_trl_times_bf16_by_default_only_where_it_is_native(monkeypatch):
    monkeypatch.setenv("GRPOLAB_CPU_KIND", "avx2")
    assert vs_trl.parse_args([]).dtype == ["float32"]
    assert vs_trl.parse_args(["--dtype", "bfloat16"]).dtype == ["bfloat16"]  # asked for: run it
    monkeypatch.setenv("GRPOLAB_CPU_KIND", "avx512_bf16")
    assert vs_trl.parse_args([]).dtype == ["bfloat16"]  # both sides' default precision there


def test_without_flags_each_side_runs_its_own_defaults():
    w = vs_trl.workload(vs_trl.parse_args([]), "float32", 0)
    assert vs_trl.grpolab_overrides(w) == []  # every grpolab switch left at its default (auto)
    assert w.trl_compile is None and w.trl_gradient_checkpointing is None  # TRL's own defaults
    args = vs_trl.parse_args(["--no-grpolab-shared-prompt", "--grpolab-compile", "--no-trl-gradient-checkpointing"])
    w = vs_trl.workload(args, "float32", 0)
    assert vs_trl.grpolab_overrides(w) == ["model.compile=true", "model.shared_prompt=false"]
    assert w.trl_gradient_checkpointing is False
    assert (args.steps, args.warmup, args.epochs) == (30, 0, 2)  # 60 optimizer steps, the first one timed too


def test_both_benches_take_every_grpolab_setting_of_the_workload():
    import dataclasses

    import roofline
    from common import Workload

    settings = sorted(f.name for f in dataclasses.fields(Workload) if f.name.startswith("grpolab_"))
    switches = [name.removeprefix("grpolab_").replace("_", "-") for name in settings if name != "grpolab_compile_scope"]
    every_one = {name: "model" if name == "grpolab_compile_scope" else True for name in settings}
    vs_trl_args = vs_trl.parse_args([f"--grpolab-{s}" for s in switches] + ["--grpolab-compile-scope", "model"])
    w = vs_trl.workload(vs_trl_args, "float32", 0)
    assert {name: getattr(w, name) for name in settings} == every_one
    roofline_args = roofline.parse_args([f"--{s}" for s in switches] + ["--compile-scope", "model"])
    assert {name: getattr(roofline_args, name) for name in settings} == every_one
    defaults = vs_trl.workload(vs_trl.parse_args([]), "float32", 0)
    assert {name: getattr(defaults, name) for name in settings} == {name: getattr(Workload(), name) for name in settings}
