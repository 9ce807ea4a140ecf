"""Inputs that used to be accepted silently: a duplicate YAML key (both lines named), a non-finite float
in any float field (the field named), and `key=value` in any position of a command line (an override,
never a config file's name)."""

from __future__ import annotations

import pytest

from grpolab import cli, config as C
from grpolab.app.pipeline import load_pipeline


def test_a_duplicate_yaml_key_names_both_lines(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: grpo\ntrain:\n  lr: 1.0e-4\n  steps: 3\n  lr: 5.0e-4\n")
    with pytest.raises(C.ConfigError, match=rf"{f}:5: train.lr: duplicate key \(first at line 3\)"):
        C.load(str(f))
    f.write_text("preset: grpo\ntrain: {steps: 3}\nmodel: {hidden_size: 32}\ntrain: {steps: 4}\n")
    with pytest.raises(C.ConfigError, match=rf"{f}:4: train: duplicate key \(first at line 2\)"):
        C.load(str(f))


def test_a_duplicate_key_in_a_pipeline_file_is_named(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("out_dir: a\ngrpo: {preset: grpo}\nout_dir: b\n")
    with pytest.raises(C.ConfigError, match=rf"{f}:3: out_dir: duplicate key \(first at line 1\)"):
        load_pipeline(str(f))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".nan", ".inf"])
@pytest.mark.parametrize("field", ["train.lr", "loss.clip_eps_high", "loss.kl_coef", "rollout.temperature",
                                   "rollout.top_p", "train.max_grad_norm", "sft.lr"])
def test_non_finite_floats_are_refused_naming_the_field(field, value):
    with pytest.raises(C.ConfigError, match=rf"{field}=.*expected a finite number"):
        C.from_preset("grpo", [f"{field}={value}"])


def test_a_non_finite_reward_weight_is_refused():
    with pytest.raises(C.ConfigError, match=r"rewards\[0\].weight=inf: expected a finite number"):
        C.from_preset("grpo", ["rewards=[{name: exact_match, weight: .inf}]"])


def test_non_finite_in_a_yaml_file_names_the_field(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: .nan\n")
    with pytest.raises(C.ConfigError, match=r"train.lr=nan: expected a finite number"):
        C.load(str(f))


@pytest.mark.parametrize("argv, config, overrides", [
    (["eval", "MODEL", "run.threads=1"], "grpo", ["run.threads=1"]),
    (["eval", "MODEL", "run.threads=1", "dapo", "train.lr=1e-3"], "dapo", ["run.threads=1", "train.lr=1e-3"]),
    (["sft", "run.threads=1"], "", ["run.threads=1"]),
    (["sft", "run.threads=1", "sft"], "sft", ["run.threads=1"]),
    (["train", "train.steps=2", "dapo", "train.lr=1e-3"], "dapo", ["train.steps=2", "train.lr=1e-3"]),
    (["data", "--out", "X", "data.seed=3"], "grpo", ["data.seed=3"]),
    (["config", "loss.kl_coef=0", "grpo"], "grpo", ["loss.kl_coef=0"]),
])
def test_key_value_is_an_override_in_any_position(argv, config, overrides, monkeypatch):
    seen = {}

    def fake_fn(args):
        seen.update(config=args.config, overrides=args.overrides)
        return 0

    parser = cli.build_parser()
    args, _ = parser.parse_known_args(argv)
    monkeypatch.setattr(cli, "build_parser", lambda: _with_fn(parser, fake_fn))
    assert cli.main(argv) == 0
    assert seen == {"config": config, "overrides": overrides}


def _with_fn(parser, fn):
    for action in parser._actions:
        for sub in (getattr(action, "choices", None) or {}).values():
            sub.set_defaults(fn=fn)
    return parser


def test_two_configs_or_none_are_one_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "grpo", "dapo"])
    assert e.value.code == 2 and "one CONFIG" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "train.steps=1"])
    assert "a CONFIG (a preset or a YAML file) is needed" in capsys.readouterr().err


def test_eval_reads_a_trailing_override_as_one(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path / "nope"), "run.threads=1"]) == 2
    err = capsys.readouterr().err
    assert f"model '{tmp_path / 'nope'}' not found" in err and "config file" not in err
