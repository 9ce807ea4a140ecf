import base64
import re

import pytest

from grpolab.report.compare import run_labels, write_compare
from grpolab.report.html import load_rows
from grpolab.report.plots import render_overlay


def test_compare_two_runs(run_factory, tmp_path):
    a = run_factory("baseline")
    b = run_factory("dr_grpo", steps=8, offset=0.3, eval_json=False)
    empty = tmp_path / "runs" / "crashed"  # a run that died before its first step
    empty.mkdir()
    out = write_compare([a, b, empty], tmp_path / "out" / "compare.html")
    text = out.read_text(encoding="utf-8")
    assert "<li><b>baseline</b>" in text and "<li><b>dr_grpo</b>" in text
    assert "<b>crashed</b>: " in text and "(no metrics)" in text
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    # Every plotted key of the report: 4 reward, 1+2+1+3+3+1+1+1 policy, 2+2 rollout, 2+4+1+1 speed
    # (time/step_s, the phase-time plot's total, gets its own overlay).
    assert len(imgs) == 4 + 13 + 4 + 8
    assert all(base64.b64decode(i)[:4] == b"\x89PNG" for i in imgs)
    # Final-values table: last reward per run (0.2 + 0.1·step + offset), eval only for baseline.
    assert re.search(r"<td>baseline</td><td class=\"num\">5</td><td class=\"num\">0.6</td>", text)
    assert re.search(r"<td>dr_grpo</td><td class=\"num\">8</td><td class=\"num\">1.2</td>", text)
    assert "0.25 → 0.5" in text and "– → –" in text
    assert "http" not in re.sub(r"base64,[^\"]+", "", text)  # no external resources


def test_overlay_skips_runs_without_the_metric(run_factory):
    runs = [("a", load_rows(run_factory("a"))), ("b", [])]
    assert render_overlay(runs, "reward/mean", "reward") is not None
    assert render_overlay(runs, "not/logged", "x") is None


def test_labels_disambiguate_same_names(tmp_path):
    dirs = [tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "z"]
    assert run_labels(dirs) == ["x/run", "y/run", "z"]


def test_compare_without_metrics_and_bad_dirs(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    text = write_compare([a], tmp_path / "c.html").read_text(encoding="utf-8")
    assert "No run has any metrics to plot." in text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_compare([a, tmp_path / "missing"], tmp_path / "c.html")
    with pytest.raises(ValueError, match="at least one"):
        write_compare([], tmp_path / "c.html")
