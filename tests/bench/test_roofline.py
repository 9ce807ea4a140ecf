"""bench/roofline.py on the tiny fixture: the peak is measured again before the first step and
after each step (outside the phase timers), and each phase is reported against both peaks."""

import sys
from pathlib import Path

import pytest
import torch


BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import roofline  # noqa: E402
import vs_trl  # noqa: E402
from common import Workload  # noqa: E402

TINY = Workload(model="tiny", prompts_per_step=2, group_size=2, max_new_tokens=4, microbatch_size=4)


def test_between_steps_runs_before_the_first_step_and_after_each():
    calls = []
    res = vs_trl.run_grpolab(TINY, steps=2, warmup=1, between_steps=lambda: calls.append(len(calls)))
    assert len(res["steps"]) == 3
    assert len(calls) == 4


def test_phases_are_reported_against_the_run_peak_and_the_local_peak(capsys, monkeypatch):
    # fp32 and bf16 before the run; then before step 0 (warm-up), after it, after step 1 (timed): the
    # timed step's local peak is (40 + 60) / 2, not the warm-up step's (10 + 40) / 2
    peaks = iter([100e9, 200e9, 10e9, 40e9, 60e9])
    monkeypatch.setattr(roofline, "gemm_peak", lambda *a, **k: next(peaks))
    roofline.run(roofline.parse_args(["--model", "tiny", "--prompts", "2", "--max-new-tokens", "4",
                                      "--microbatch", "8", "--steps", "1", "--warmup", "1"]))
    out = capsys.readouterr().out
    assert "peak around each timed step (mean of the measurements before and after it): 50 GFLOP/s" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("generate", "logprob", "learn", "step")}
    assert set(rows) == {"generate", "logprob", "learn", "step"}
    for name, cols in rows.items():
        rate = float(cols[3])  # GFLOP/s
        assert rate > 0, name
        # bf16 run: "of peak" against 200 GFLOP/s, "of local" against 50 (4x the fraction). Tolerance:
        # the printed rate is rounded to 0.05 GFLOP/s and each percentage to 0.05 points.
        assert float(cols[4].rstrip("%")) == pytest.approx(rate / 200 * 100, abs=0.05 / 200 * 100 + 0.051), name
        assert float(cols[5].rstrip("%")) == pytest.approx(rate / 50 * 100, abs=0.05 / 50 * 100 + 0.051), name


def test_without_native_bf16_only_the_fp32_peak_is_measured(capsys, monkeypatch):
    # an emulated bf16 GEMM of 2048³ takes ~15 s a call on an AVX2-only CPU: a float32 run there
    # measures the fp32 peak alone
    measured = []
    monkeypatch.setenv("GRPOLAB_CPU_KIND", "avx2")
    monkeypatch.setattr(roofline, "gemm_peak", lambda dtype, *a, **k: measured.append(dtype) or 100e9)
    roofline.run(roofline.parse_args(["--dtype", "float32", "--peak-only"]))
    assert measured == [torch.float32]
    assert "bf16 not measured" in capsys.readouterr().out
    monkeypatch.setenv("GRPOLAB_CPU_KIND", "avx512_bf16")
    measured.clear()
    roofline.run(roofline.parse_args(["--dtype", "float32", "--peak-only"]))
    assert measured == [torch.float32, torch.bfloat16]


def test_a_shared_prompt_is_counted_once_per_group_in_the_log_prob_passes():
    shape = {"decoder_weights": 1000, "layers": 2, "attn_width": 8, "hidden": 4, "vocab": 16}
    rows = Workload(prompts_per_step=3, group_size=4, epochs=2, beta=0.04)
    shared = Workload(prompts_per_step=3, group_size=4, epochs=2, beta=0.04, grpolab_shared_prompt=True)
    per_row, per_group = roofline.step_flops(shape, rows, 5.0, 7.0), roofline.step_flops(shape, shared, 5.0, 7.0)
    assert per_group["generate"] == per_row["generate"]  # the prefill is per group either way
    # the 12 - 3 prompt copies no longer computed, each 5 tokens at mean context 2.5
    saved = (12 - 3) * 5 * (2 * 1000 + 4 * 2 * 8 * 2.5)
    torch.testing.assert_close(per_row["logprob"] - per_group["logprob"], saved)
    torch.testing.assert_close(per_row["learn"] - per_group["learn"], 3 * 2 * saved)
    # per row, a pass is the rows' whole sequences at the mean context (5 + 7) / 2
    seq = 12 * 12 * (2 * 1000 + 4 * 2 * 8 * 6.0) + 12 * 7 * 2 * 4 * 16
    torch.testing.assert_close(per_row["logprob"], float(seq))
