"""bench/dist_scaling.py without launching a model: the ratios and the table from fake rank results,
the byte counts of a tiny module, and the commands the driver starts."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "bench" / "dist_scaling.py"
_spec = importlib.util.spec_from_file_location("bench_dist_scaling", _PATH)
ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)

MB = 1_000_000


def _rank(config, rank, world, steps_per_s, total_mb, engine_mb=0.0, rss=2.0, **extra):
    p = total_mb / 4 * MB
    return {"config": config, "rank": rank, "world_size": world, "threads": 1 if world > 1 else 2, "device": "cpu",
            "steps_per_s": steps_per_s, "rollout_s": 1.0, "learn_s": 2.0, "step_s": 3.0, "peak_rss_gb": rss,
            "bytes": {"params": p, "grads": p, "optimizer": 2 * p, "total": 4 * p, "engine_copy": engine_mb * MB},
            **extra}


def _fake():
    return {"single": [_rank("single", 0, 1, 0.10, 2152)],
            "ddp": [_rank("ddp", 0, 2, 0.12, 2152), _rank("ddp", 1, 2, 0.15, 2152)],
            "fsdp2": [_rank("fsdp2", 0, 2, 0.08, 1076, 538, rss=3.1, peak_rss_setup_gb=1.5, peak_rss_steps_gb=3.1),
                      _rank("fsdp2", 1, 2, 0.09, 1076, 538, peak_rss_setup_gb=1.25, peak_rss_steps_gb=2.75)]}


def test_summary_takes_the_slowest_rank_and_the_ratios_against_one_process_and_ddp():
    rows = {r["config"]: r for r in ds.summarize(_fake())}
    assert rows["ddp"]["steps_per_s"] == 0.12 and rows["ddp"]["speed_vs_single"] == pytest.approx(1.2)
    assert rows["single"]["speed_vs_single"] == 1.0
    assert rows["fsdp2"]["state_vs_ddp"] == pytest.approx(0.5)
    assert rows["single"]["state_vs_ddp"] == pytest.approx(1.0)
    assert rows["fsdp2"]["peak_rss_gb"] == 3.1 and rows["fsdp2"]["engine_copy_mb"] == pytest.approx(538)
    assert rows["fsdp2"]["cuda_peak_gb"] is None


def test_summary_without_the_baselines_leaves_the_ratios_empty():
    (row,) = ds.summarize({"fsdp2": _fake()["fsdp2"]})
    assert row["speed_vs_single"] is None and row["state_vs_ddp"] is None
    table = ds.format_table([row])
    assert "| FSDP2 | 2 × 1 | 0.080 | — |" in table and "| — | 538 |" in table


def test_table_has_one_row_per_configuration_and_a_gpu_column_only_with_cuda_results():
    table = ds.format_table(ds.summarize(_fake()))
    lines = table.splitlines()
    assert len(lines) == 5 and "peak GPU" not in lines[0]
    assert lines[2].startswith("| 1 process | 1 × 2 | 0.100 | 1.00× |")
    assert "2152 (538 + 538 + 1076) | 1.00 | — (shared) |" in lines[3]
    assert "| 1.50 / 3.10 | 1076 (269 + 269 + 538) | 0.50 | 538 |" in lines[4]
    assert "| 2.00 | 2152 (538 + 538 + 1076) | 1.00 | — (shared) |" in lines[3]  # the process's peak only
    gpu = {"fsdp2": [_rank("fsdp2", 0, 1, 1.0, 1076, 538, cuda_peak_gb=1.25)]}
    assert "peak GPU mem" in ds.format_table(ds.summarize(gpu)) and "| 1.25 |" in ds.format_table(ds.summarize(gpu))


def test_repeated_runs_give_the_median_speed_and_the_ratio_of_each_pair_of_runs():
    results = {"single": [_rank("single", 0, 1, v, 2152, repeat=i) for i, v in enumerate((0.10, 0.20, 0.12))],
               "ddp": [_rank("ddp", k, 2, v + k * 0.01, 2152, repeat=i)
                       for i, v in enumerate((0.11, 0.22, 0.24)) for k in (0, 1)]}
    rows = {r["config"]: r for r in ds.summarize(results)}
    assert rows["single"]["steps_per_s"] == 0.12 and rows["ddp"]["steps_per_s"] == 0.22
    assert rows["ddp"]["runs"] == 3 and rows["ddp"]["speed_vs_single"] == pytest.approx(0.22 / 0.12)
    assert rows["ddp"]["speed_vs_single_runs"] == pytest.approx([1.1, 1.1, 2.0])
    assert "| 1.83× (1.10, 1.10, 2.00) |" in ds.format_table(list(rows.values()))


def test_report_reads_a_work_folder_or_one_configuration_folder(tmp_path):
    for config, ranks in _fake().items():
        for repeat in (0, 1):
            (tmp_path / config / f"run{repeat}").mkdir(parents=True)
            for r in ranks:
                (tmp_path / config / f"run{repeat}" / f"rank{r['rank']}.json").write_text(json.dumps(r))
    found = ds.report_dir(tmp_path)
    assert list(found) == ["single", "ddp", "fsdp2"]
    assert [(r["repeat"], r["rank"]) for r in found["ddp"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["rank"] for r in ds.report_dir(tmp_path / "fsdp2" / "run1")["fsdp2"]] == [0, 1]
    assert ds.summarize(found)[2]["runs"] == 2


def test_bytes_count_each_parameter_once_and_the_local_shard_of_a_dtensor():
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    n = 4 * 3 + 3
    got = ds.state_bytes(lin, opt)
    assert got["params"] == got["grads"] == 4 * n
    assert got["optimizer"] == 2 * 4 * n + 2 * 4  # exp_avg, exp_avg_sq, and a float32 `step` per parameter

    class Sharded:  # what a DTensor offers
        def to_local(self):
            return torch.zeros(5, dtype=torch.bfloat16)

    assert ds.local_bytes(Sharded()) == 10 and ds.local_bytes(None) == 0
    tied = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Linear(2, 5, bias=False))
    tied[1].weight = tied[0].weight
    assert ds.module_bytes(tied) == 5 * 2 * 4


def test_commands_one_process_without_launcher_variables_and_ranks_under_torchrun(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    args = ds.parse_args([])
    argv, env = ds.command(args, "single", tmp_path)
    assert "torch.distributed.run" not in argv and "WORLD_SIZE" not in env and "RANK" not in env
    assert argv[argv.index("--parallel") + 1] == "none" and env["OMP_NUM_THREADS"] == "2"
    argv, env = ds.command(args, "fsdp2", tmp_path)
    assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert argv[argv.index("--parallel") + 1] == "fsdp2" and env["OMP_NUM_THREADS"] == "1"
    assert argv[6] == str(_PATH)
    worker = ds.parse_args(argv[7:])  # the worker parses what the driver passes
    assert worker.worker and (worker.prompts, worker.group_size, worker.minibatch, worker.microbatch) == (4, 4, 16, 4)


def test_the_benchmark_config_is_valid_with_global_sizes():
    cfg = ds.bench_config(ds.parse_args([]), "fsdp2")
    cfg.validate()
    assert cfg.train.parallel == "fsdp2" and not cfg.needs_reference
    assert (cfg.sequences_per_step, cfg.train.minibatch_size, cfg.train.microbatch_size) == (16, 16, 4)
    assert cfg.train.steps == 4 and cfg.model.dtype == "float32"
    # every row is learned on even when all rewards are 0 (SmolLM2 rarely answers builtin:arith exactly)
    assert not cfg.loss.filter_zero_std_groups and not cfg.loss.mask_truncated
