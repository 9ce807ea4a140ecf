"""The command line: settings that act on the process (run.threads)."""

import torch

from grpolab import cli

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "train.steps=1", "train.minibatch_size=4", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false"]


def test_run_threads_sets_torch_threads_and_zero_leaves_them(tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cli.main(["train", "grpo", *TINY, f"run.out_dir={tmp_path}/a", "run.threads=1"]) == 0
        assert torch.get_num_threads() == 1
        assert cli.main(["train", "grpo", *TINY, f"run.out_dir={tmp_path}/b"]) == 0  # 0: torch's default, untouched
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_negative_threads_is_a_config_error(capsys):
    assert cli.main(["train", "grpo", *TINY, "run.threads=-1"]) == 2
    assert "run.threads=-1" in capsys.readouterr().err
