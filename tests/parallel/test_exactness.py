"""Data parallelism is exact: one optimizer step at world size 2 (gloo ranks on this CPU, DDP and
FSDP2) gives the weights of world size 1 on the same rows, for every aggregation mode; a per-rank
normalizer (the guard) does not."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from grpolab import config as C
from grpolab.algo.losses import AGGREGATIONS
from grpolab.data.arith import ArithTask
from grpolab.data.stream import ArithStream
from grpolab.parallel.parallel import Parallel
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.batch import Rollout
from grpolab.grpo import loop as grpo
from grpolab.grpo.setup import build_setup
from grpolab.grpo.stats import StepStats

WORLD = 2
# Every aggregation but those that divide each microbatch by its own token count on purpose (TRL's
# bnpo, `Aggregation.per_microbatch`): on 2 ranks each rank cuts its own rows into microbatches,
# so their token means differ from one process's and the update is NOT the same, by design.
EXACT_MODES = [mode for mode, agg in AGGREGATIONS.items() if not agg.per_microbatch]
N, LP, LC, G = 8, 3, 6, 2  # rows, prompt width, completion width, group size: rank r learns on rows 4r .. 4r+3


class PerRankNormalizer(Parallel):
    """The guard: each rank divides by its own rows' normalizer instead of the minibatch's."""

    def all_reduce_sum(self, value):
        return value


def _rollout() -> Rollout:
    """A fixed rollout whose two halves carry different token counts (so a per-rank normalizer differs).
    Rows 0, 3 and 6 are agent episodes: an environment token (real, not trained) between policy tokens."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 1, 2, 6, 3, 3, 6, 5])
    real = torch.arange(LC)[None, :] < lengths[:, None]
    loss_mask = real.clone()
    loss_mask[[0, 3, 6], 2] = False  # the environment's tokens: context only
    prompts = torch.randint(3, 20, (N // G, LP), generator=g).repeat_interleave(G, 0)
    ids = torch.cat([prompts, torch.randint(3, 20, (N, LC), generator=g)], 1)
    return Rollout(input_ids=ids, attention_mask=torch.cat([torch.ones(N, LP, dtype=torch.bool), real], 1),
                   prompt_len=LP, loss_mask=loss_mask, truncated=torch.zeros(N, dtype=torch.bool), group_size=G,
                   ref_logp=-torch.rand(N, LC, generator=g, dtype=torch.float64) * loss_mask,
                   advantages=torch.randn(N, generator=g, dtype=torch.float64))


def _step(mode: str, parallel: Parallel) -> tuple[dict[str, torch.Tensor], dict]:
    """One GRPO learning phase (one minibatch of all rows, microbatches of 2) on this rank's rows with
    SGD (an update proportional to the gradient); returns the full updated state on every rank and
    the step's statistics reduced over ranks (sums, ratio extremes, the minibatch loss)."""
    cfg = C.from_preset("grpo", [f"loss.loss_agg={mode}", "loss.kl_coef=0.04", f"rollout.prompts_per_step={N // G}",
                                 f"rollout.group_size={G}", f"train.minibatch_size={N}", "train.microbatch_size=2",
                                 "train.max_grad_norm=0", "run.tensorboard=false", "run.progress=false",
                                 "model.dtype=float32"])  # exactness and invariance are float32 checks (auto picks bf16 on CPUs with native bf16)
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).double()
    s = build_setup(cfg, policy=model, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))
    s.services.parallel, s.models.train_model = parallel, parallel.wrap(model)
    s.optim.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    s.optim.scheduler = torch.optim.lr_scheduler.LambdaLR(s.optim.optimizer, lambda i: 1.0)
    rows = torch.arange(N).view(parallel.world_size, -1)[parallel.rank]
    st = StepStats(0)
    grpo.learn(s, _rollout().select(rows), st)
    st.reduce(parallel)
    stats = {**st.sums, "ratio_min": st.ratio_min, "ratio_max": st.ratio_max, "loss": st.losses[0]}
    if parallel.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)), stats
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats


def _rank(rank: int, port: int, strategy: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        results = {}
        for mode in EXACT_MODES:
            results[mode] = _step(mode, Parallel(rank, WORLD, strategy))
        results["guard"] = _step("token-mean", PerRankNormalizer(rank, WORLD, strategy))
        if rank == 0:
            torch.save(results, out)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_update_the_weights_of_one_process(strategy, tmp_path, free_port):
    out = str(tmp_path / "ranks.pt")
    mp.start_processes(_rank, args=(free_port(), strategy, out), nprocs=WORLD, start_method="spawn")
    got = torch.load(out)
    for mode in EXACT_MODES:
        want, want_stats = _step(mode, Parallel())
        weights, stats = got[mode]
        assert set(weights) == set(want)
        for name in want:
            # float64 weights: the two sides differ only by the order of float additions
            torch.testing.assert_close(weights[name], want[name], msg=f"{strategy} {mode} {name}")
        # the step's metrics reduced over ranks are the one-process metrics (sums, extremes, the loss)
        torch.testing.assert_close(stats, want_stats, msg=f"{strategy} {mode} statistics")
    want, _ = _step("token-mean", Parallel())
    guard, _ = got["guard"]
    moved = [name for name in want if not torch.allclose(guard[name], want[name], rtol=1e-6, atol=1e-9)]
    assert moved, "a per-rank normalizer must change the update (else this test could not fail)"
