"""bench/checkpointing.py on the tiny model: both settings run in their own process and the driver prints
each one's peak RSS and times, then the ratios."""

import importlib.util
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_checkpointing", REPO / "bench" / "checkpointing.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_bench_runs_both_settings_on_the_tiny_model(capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert bench.main(["--model", "builtin:tiny", "--steps", "1", "--warmup", "0", "--prompts", "2",
                       "--group-size", "2", "--max-new-tokens", "4", "--microbatch", "4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "gradient_checkpointing=false" in out and "gradient_checkpointing=true" in out
    assert "with / without: peak RSS" in out
