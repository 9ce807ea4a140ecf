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


def _config_output(capsys, *argv):
    assert cli.main(["config", *argv]) == 0
    return capsys.readouterr().out


def test_config_reference_lists_every_field(capsys):
    import dataclasses

    from grpolab import config as C

    out = _config_output(capsys, "dapo")
    lines = out.splitlines()
    for f in dataclasses.fields(C.Config):
        value = getattr(C.Config(), f.name)
        if dataclasses.is_dataclass(value):
            assert f"[{f.name}]  ({type(value).__name__})" in lines
            for g in dataclasses.fields(value):
                assert any(line.startswith(f"{f.name}.{g.name}: ") for line in lines), f"{f.name}.{g.name}"
        elif f.name == "rewards":
            assert "[rewards]  (tuple[RewardSpec, ...])" in lines
            for g in dataclasses.fields(C.RewardSpec):
                assert any(line.startswith(f"rewards[].{g.name}: ") for line in lines), g.name
        else:
            assert any(line.startswith(f"{f.name}: ") for line in lines), f.name
    assert "loss.loss_agg: str = token-mean" in lines  # the preset's value
    assert "loss.clip_eps_high: float = 0.28" in lines
    assert "rewards[0]: RewardSpec = {kwargs: {}, label: '', name: exact_match, verifier: null, weight: 1.0}" in lines


def _choices(out: str, field: str) -> list[str]:
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"{field}: "))
    j = next(j for j in range(i + 1, len(lines)) if lines[j].strip() in ("choices:", "known names (or 'module:attr'):"))
    out_choices = []
    for line in lines[j + 1:]:
        if not line.startswith("      "):
            break
        out_choices.append(line.split()[0])
    return out_choices


def test_config_reference_choices_come_from_the_registries(capsys):
    from grpolab.algo.advantages import ADVANTAGE_ESTIMATORS
    from grpolab.algo.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
    from grpolab.rewards.registry import reward_names

    out = _config_output(capsys, "grpo")
    assert _choices(out, "loss.loss_agg") == list(AGGREGATIONS)
    assert _choices(out, "loss.kl_estimator") == list(KL_ESTIMATORS)
    assert _choices(out, "loss.advantage") == list(ADVANTAGE_ESTIMATORS)
    assert _choices(out, "loss.policy_loss") == [*POLICY_LOSSES, "sft"]
    assert _choices(out, "rewards[].name") == reward_names()
    assert "[verifier]" in out.split("rewards[].name: ")[1].split("rewards[].weight")[0]


def test_config_reference_of_a_yaml_file_with_overrides(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("preset: rloo\nrollout:\n  group_size: 4\nrewards:\n  - {name: format, weight: 0.5}\n")
    out = _config_output(capsys, str(p), "train.steps=7")
    lines = out.splitlines()
    assert "loss.advantage: str = rloo" in lines and "rollout.group_size: int = 4" in lines
    assert "train.steps: int = 7" in lines and "rewards[].name: str = [format]" in lines


def test_config_reference_of_a_bad_config_is_a_config_error(capsys):
    assert cli.main(["config", "a2c"]) == 2
    assert "'a2c' is neither a preset (sft, onpolicy_sft" in capsys.readouterr().err
