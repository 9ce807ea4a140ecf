"""GRPO on tool episodes without an environment (rollout.tools only): the prompts open the episodes, an
episode ends at the first turn without a call, and rewards that read the episode (tool_use, overlong) are
probed at start-up on an episode with no turn yet and score every episode."""

from __future__ import annotations

import json

from grpolab import config as C
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup


def test_a_tools_only_run_trains_and_logs_the_tool_reward(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}*{b}=?", "answer": str(a * b)}) + "\n"
                            for a in range(2, 6) for b in range(3, 7)))
    cfg = C.from_preset("grpo", [
        "model.name_or_path=builtin:tiny-chat", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "model.dtype=float32", f"data.source=jsonl:{data}", "rollout.tools=[grpolab.agents.builtin:calculator]",
        "rollout.max_turns=2", "rollout.max_new_tokens=6", "rollout.max_episode_tokens=2048",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "train.minibatch_size=4", "train.microbatch_size=4",
        "train.steps=2", "rewards=[tool_use:1.0, {name: overlong, weight: 0.1, kwargs: {buffer_len: 4}}]",
        "run.progress=false", "run.tensorboard=false"])
    assert train_in_run_dir(build_setup(cfg), tmp_path / "run") == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= row["reward/tool_use/mean"] <= 1.0 and row["episode/turns"] >= 1.0
        assert row["reward/overlong/mean"] <= 0.0
        assert "episode/tool_calls" in row
