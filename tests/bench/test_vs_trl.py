"""bench/vs_trl.py's command line."""

import sys
from pathlib import Path

import grpolab.models.loading as loading

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import vs_trl  # noqa: E402


def test_vs_trl_times_bf16_by_default_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: False)
    assert vs_trl.parse_args([]).dtype == ["float32"]
    assert vs_trl.parse_args(["--dtype", "bfloat16"]).dtype == ["bfloat16"]  # asked for: run it
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: True)
    assert vs_trl.parse_args([]).dtype == ["float32", "bfloat16"]
