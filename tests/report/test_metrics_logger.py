import json
import math

import numpy as np
import pytest
import torch

from grpolab.report.metrics import MetricsLogger, mfu, model_flops_per_token, read_metrics


def test_logger_writes_valid_json_lines_with_nan_as_null(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"step": 0, "reward/mean": 0.5, "kl": float("nan")})
        written = log.log({"step": 1, "reward/mean": torch.tensor(0.25), "kl": float("inf"),
                           "len/max": np.int64(7), "grad_norm": np.float32(-math.inf)})
        # Flushed after every row: readable before close.
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert written == {"step": 1, "reward/mean": 0.25, "kl": None, "len/max": 7,
                       "grad_norm": None}
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert "NaN" not in lines[0] and "Infinity" not in lines[1]
    rows = [json.loads(line) for line in lines]  # strict JSON parses
    assert rows[0] == {"step": 0, "reward/mean": 0.5, "kl": None}
    assert isinstance(rows[1]["len/max"], int)
    assert read_metrics(tmp_path) == rows


def test_logger_appends_on_reopen(tmp_path):
    for step in range(2):
        with MetricsLogger(tmp_path, tensorboard=False) as log:
            log.log({"step": step, "loss": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_logger_rejects_rows_without_integer_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        with pytest.raises(ValueError, match="integer 'step'"):
            log.log({"reward/mean": 1.0})
        with pytest.raises(TypeError, match="not JSON-serialisable"):
            log.log({"step": 0, "x": object()})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_logger_writes_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        for step in range(3):
            log.log({"step": step, "reward/mean": 0.1 * step, "kl": None, "note": "text"})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward/mean"]  # null and non-numeric values skipped
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in events], [0.0, 0.1, 0.2], rtol=1e-6)


def test_wandb_missing_names_pip_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=True)


def test_read_metrics_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n\n{"step": 1, "kl": NaN-ish}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: invalid JSON"):
        read_metrics(path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{path}:2: expected a JSON object"):
        read_metrics(path)
    path.write_text('{"step": 0}\n{"step": "1"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: 'step' must be an integer"):
        read_metrics(path)


def test_model_flops_per_token_counts():
    n = 1_000_000
    assert model_flops_per_token(n, backward=False) == 2 * n
    assert model_flops_per_token(n, backward=True) == 6 * n
    # Attention: QK^T and AV, 2 FLOPs per multiply-add each, per layer, per context position.
    fwd = model_flops_per_token(n, backward=False, n_layers=2, d_model=64, context_len=128)
    assert fwd == 2 * n + 2 * 2 * 2 * 64 * 128
    assert model_flops_per_token(n, backward=True, n_layers=2, d_model=64,
                                 context_len=128) == 3 * fwd
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        model_flops_per_token(-1, backward=True)


def test_mfu():
    assert mfu(6e12 * 1000, 1.2e16) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 0.0)
    with pytest.raises(ValueError, match="flops_per_s"):
        mfu(float("nan"), 1.0)
