"""The numerics guard: a non-finite loss or gradient skips that optimizer step and is logged;
train.max_skipped_steps consecutive skips stop the run with a message and a checkpoint of the last
good state. Log-ratios are clamped to ±LOG_RATIO_CLAMP before exp."""

import json

import pytest
import torch

from grpolab import config as C
from grpolab.algo.losses import LOG_RATIO_CLAMP, clipped_surrogate, kl_penalty, sequence_clipped_surrogate
from grpolab.rundir import checkpoint as ck
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup

# 8 sequences per step, minibatches of 4, microbatches of 2: 2 optimizer steps and 4 objective calls per step
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "train.minibatch_size=4", "train.microbatch_size=2", "train.lr=1e-2", "loss.entropy_coef=0.01",
        "run.progress=false", "run.tensorboard=false"]
CALLS_PER_STEP = 4


class _Poison:
    """Wraps the objective; `poison(call_index, loss)` may return a non-finite loss."""

    def __init__(self, obj, poison):
        self.obj, self.poison, self.calls = obj, poison, 0

    def normalizer(self, mask):
        return self.obj.normalizer(mask)

    def __call__(self, model, micro, normalizer):
        loss, stats = self.obj(model, micro, normalizer)
        self.calls += 1
        return self.poison(self.calls - 1, loss, model), stats


def _run(tmp_path, poison, *ov):
    s = build_setup(C.from_preset("grpo", TINY + list(ov)))
    s.optim.objective = _Poison(s.optim.objective, poison)
    snapshots = {}  # step -> (weights, data cursor) at its end

    def snap(step, *rest):
        weights = {k: v.clone() for k, v in s.models.policy.state_dict().items()}
        snapshots[step] = (weights, json.loads(json.dumps(s.data.prompts.state_dict())))

    s.services.hooks.append(snap)
    code = train_in_run_dir(s, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return s, code, rows, snapshots


def test_a_nan_loss_skips_only_that_optimizer_step(tmp_path):
    # call 4 = step 1, first minibatch, first microbatch
    s, code, rows, _ = _run(tmp_path, lambda i, loss, m: loss * float("nan") if i == 4 else loss,
                                "train.steps=3", "train.max_skipped_steps=2")
    assert code == 0
    assert [r["skipped_steps"] for r in rows] == [0, 1, 0]
    assert s.consecutive_skips == 0  # reset by the next good step
    assert all(r["loss"] is not None and r["grad_norm"] > 0 for r in rows)  # the skipped one is not averaged in


class _InfGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back becomes inf."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


# Skipping step 0's first optimizer step makes torch warn that the scheduler stepped first: expected.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")
def test_a_nonfinite_gradient_with_a_finite_loss_is_skipped(tmp_path):
    def poison(i, loss, model):
        if i == 1:  # step 0, first minibatch, second microbatch: the gradient becomes inf
            assert torch.isfinite(loss)
            return _InfGrad.apply(loss)
        return loss

    _, code, rows, _ = _run(tmp_path, poison, "train.steps=2")
    assert code == 0
    assert [r["skipped_steps"] for r in rows] == [1, 0]
    assert all(r["loss"] is not None for r in rows)


def test_consecutive_skips_stop_with_a_message_and_the_last_good_state(tmp_path, capsys):
    # from step 2 on every loss is NaN: step 2 skips 2 optimizer steps, step 3 the third -> stop
    start = 2 * CALLS_PER_STEP
    _, code, rows, snaps = _run(tmp_path, lambda i, loss, m: loss * float("nan") if i >= start else loss,
                                "train.steps=6", "train.max_skipped_steps=3", "run.checkpoint_every=0")
    err = capsys.readouterr().err
    assert code == 3
    assert "3 consecutive optimizer steps had a non-finite loss or gradient" in err
    assert "train.max_skipped_steps" in err and "last good state is saved in" in err
    assert [r["skipped_steps"] for r in rows] == [0, 0, 2]  # step 3 never finished
    path = ck.latest_checkpoint(tmp_path / "checkpoints")
    assert path is not None and path.name == "step-3" and str(path) in err
    fresh = build_setup(C.from_preset("grpo", TINY + ["train.steps=6"]))
    assert ck.load_checkpoint(fresh, path) == 3
    # the weights of the last good optimizer step (end of step 1; steps 2 and 3 changed nothing)
    for k, v in fresh.models.policy.state_dict().items():
        assert torch.equal(v, snaps[1][0][k]), k
        assert torch.isfinite(v).all()
    # and the step boundary: the data cursor as step 2 left it, a fresh skip counter
    assert json.loads((path / "data.json").read_text()) == snaps[2][1]
    assert fresh.consecutive_skips == 0


def test_log_ratios_are_clamped_so_extreme_ratios_stay_finite():
    assert LOG_RATIO_CLAMP == 20.0  # as verl; exp(20) ≈ 4.9e8 is finite in fp32 and bf16
    logp = torch.tensor([[-1000.0, 0.0, -0.1]], requires_grad=True)
    old = torch.tensor([[0.0, -1000.0, -0.1]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for fn in (clipped_surrogate, sequence_clipped_surrogate):
        loss, st = fn(logp, old, torch.tensor([1.0]), mask)
        assert torch.isfinite(loss).all() and torch.isfinite(st["ratio"]).all()
        assert float(st["ratio"].max()) <= torch.exp(torch.tensor(LOG_RATIO_CLAMP)).item() * (1 + 1e-6)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(grad).all()
    for est in ("k1", "k2", "k3"):
        kl = kl_penalty(logp, old, est)
        assert torch.isfinite(kl).all(), est
