"""`grpolab demo --agent --quick`: the whole agent path (π0 SFT on scripted transcripts, GRPO on the
calculator-tool task and on GuessNumber, held-out evaluation, reports) runs, writes its folders, and
continues with --resume."""

from __future__ import annotations

import json

from grpolab.app.demo_agent import format_table, run_agent_demo

QUIET = ["run.progress=false", "run.tensorboard=false", "run.threads=1"]


def test_the_quick_agent_demo_runs_both_tasks_and_resumes(tmp_path):
    out = tmp_path / "agent"
    payload = run_agent_demo(seed=0, quick=True, out=str(out), overrides=QUIET)
    assert set(payload["tasks"]) == {"calculator", "guess"}
    for task in ("calculator", "guess"):
        for when in ("pi0", "final"):
            m = payload["tasks"][task][when]
            assert m["episodes"] == 16 and 0.0 <= m["solved"] <= 1.0 and m["turns/mean"] >= 1.0
        rows = [json.loads(x) for x in (out / task / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all("episode/turns" in r and "reward/environment/mean" in r for r in rows)
        assert '"episode": {' in (out / task / "samples.jsonl").read_text()
        assert (out / task / "report.html").is_file() and (out / task / "final").is_dir()
    assert payload["tasks"]["calculator"]["final"]["tool_calls/count"] >= 0
    assert (out / "pi0" / "model.safetensors").is_file() and json.loads((out / "eval.json").read_text())["seed"] == 0
    again = run_agent_demo(seed=0, quick=True, out=str(out), overrides=QUIET, resume=True, report=False)
    assert again["tasks"]["guess"]["final"] == payload["tasks"]["guess"]["final"]  # the finished runs, as they were


def test_the_table_keeps_its_columns_aligned_and_skips_missing_figures():
    m = {"solved": 0.5, "turns_to_solve/mean": None, "tool_calls/mean": 1.0, "tool_calls/well_formed": 0.75}
    lines = format_table({"calculator": {"pi0": {**m, "sampled": m}, "final": {**m, "sampled": m}}}).splitlines()
    assert len(lines) == 1 + 2 * 3 and len({len(line) for line in lines}) == 1
    assert lines[-1].split() == ["calculator", "sampled", "tool_calls/well_formed", "0.750", "0.750"]
