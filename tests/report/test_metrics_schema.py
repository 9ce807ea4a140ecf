import pytest

from grpolab.report.schema import (METRICS, describe, reward_fn_names, validate_metrics_row,
                                   validate_sample_row)


def test_schema_lists_every_key_once_with_description_and_unit():
    keys = [m.key for m in METRICS]
    assert len(keys) == len(set(keys))
    assert all(m.description and m.unit for m in METRICS)
    for key in ("step", "reward/mean", "kl", "clip/high_frac", "time/step_s", "mfu",
                "tokens_per_s/learn", "skipped_steps", "reward_errors", "accuracy"):
        assert key in keys


def test_valid_row_passes_with_extras_and_nulls(make_row, reward_names):
    row = make_row(3)
    row["kl"] = None
    row["some/new_metric"] = "anything"
    validate_metrics_row(row, reward_names=reward_names)
    del row["accuracy"]  # optional: no verifier
    validate_metrics_row(row)


def test_invalid_rows_list_every_problem(make_row):
    row = make_row(2)
    del row["kl"]
    row["step"] = 2.0
    row["entropy"] = "high"
    row["skipped_steps"] = 1.5
    row["reward/accuracy_rm/mean"] = float("nan")
    with pytest.raises(ValueError) as e:
        validate_metrics_row(row, reward_names=["accuracy_rm", "format"])
    msg = str(e.value)
    for part in ("missing key 'kl'", "'step' must be an integer", "'entropy' must be a number",
                 "'skipped_steps' must be an integer", "write non-finite floats as null",
                 "missing key 'reward/format/mean'"):
        assert part in msg
    with pytest.raises(ValueError, match="must be >= 0"):
        validate_metrics_row({**make_row(0), "step": -1})
    with pytest.raises(ValueError, match="JSON object"):
        validate_metrics_row([1])


def test_reward_fn_names_and_describe(make_row, reward_names):
    assert reward_fn_names(make_row(0)) == reward_names
    assert describe("reward/accuracy_rm/std").unit == "reward"
    assert "accuracy_rm" in describe("reward/accuracy_rm/mean").description
    assert describe("kl").unit == "nats/token"
    assert describe("unknown/key") is None


def test_validate_sample_row():
    good = {"step": 1, "prompt": "p", "meta": {}, "completions": [
        {"text": "t", "rewards": {"a": 1.0, "b": None}, "reward": 1.0, "advantage": 0.0,
         "length": 3, "truncated": False}]}
    validate_sample_row(good)
    bad = {**good, "completions": [{**good["completions"][0], "text": 5}]}
    with pytest.raises(ValueError, match=r"completions\[0\].text must be a string"):
        validate_sample_row(bad)
    with pytest.raises(ValueError, match="'step' must be an integer"):
        validate_sample_row({**good, "step": "1"})
