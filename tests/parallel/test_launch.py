"""The launch helpers: `--nproc N` becomes a torchrun command, per-rank seeds, Phase A's sharding,
and the step statistics a rank reduces (checked here with one process; test_torchrun.py runs ranks)."""

from __future__ import annotations

import sys

import pytest
import torch

from grpolab.parallel.launch import init_parallel, launched, step_seed, strip_nproc, torchrun_command
from grpolab.parallel.parallel import Parallel
from grpolab.grpo.stats import StepRecord


def test_nproc_becomes_a_standalone_torchrun_of_the_same_command():
    argv = ["train", "my.yaml", "train.steps=3", "--nproc", "4", "--resume"]
    assert strip_nproc(argv) == ["train", "my.yaml", "train.steps=3", "--resume"]
    assert strip_nproc(["train", "x.yaml", "--nproc=2"]) == ["train", "x.yaml"]
    assert torchrun_command(4, strip_nproc(argv)) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "grpolab", "train", "my.yaml", "train.steps=3", "--resume"]


def test_without_a_launcher_there_is_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not launched()
    par = init_parallel("cpu", "fsdp2")
    assert par == Parallel() and not par.active and par.is_main
    assert not torch.distributed.is_initialized()


def test_seeds_differ_per_rank_step_and_stream_and_are_stable():
    seeds = {step_seed(s, r, t, k) for s in (0, 1) for r in (0, 1) for t in (0, 1, 7) for k in ("sample", "shuffle")}
    assert len(seeds) == 24 and all(0 <= x < 2**63 for x in seeds)
    assert step_seed(0, 1, 7, "sample") == step_seed(0, 1, 7, "sample")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_takes_a_contiguous_equal_share_of_the_prompts(world):
    items = list(range(8))
    shares = [Parallel(rank, world, "ddp").shard(items) for rank in range(world)]
    assert [x for share in shares for x in share] == items
    assert {len(share) for share in shares} == {8 // world}


def _record(rewards, prompts):
    n = len(rewards)
    return StepRecord(items=list(prompts), texts=[f"t{i}" for i in range(n)], scores={"r": torch.tensor(rewards)},
                      rewards=torch.tensor(rewards), advantages=torch.arange(n, dtype=torch.float32),
                      lengths=torch.full((n,), 3), truncated=torch.zeros(n, dtype=torch.bool), group_size=2)


def test_merged_records_concatenate_the_ranks_groups_in_rank_order():
    a, b = _record([1.0, 0.0], ["p0"]), _record([0.5, 0.5], ["p1"])
    m = StepRecord.merge([a, b])
    assert m.items == ["p0", "p1"] and m.texts == ["t0", "t1", "t0", "t1"] and m.group_size == 2
    torch.testing.assert_close(m.rewards, torch.tensor([1.0, 0.0, 0.5, 0.5]))
    torch.testing.assert_close(m.scores["r"], m.rewards)
    assert StepRecord.merge([a]) is a
