"""The GRPO loop: Phase A (rollout, rewards, advantages; no grad), then Phase B (learning).

    for step:
        Phase A  π_old = the current policy, frozen. Sample G completions per prompt (agent runs: G
                 episodes per item, environment and tool replies as untrained context), score them
                 (rollout.dynamic_sampling: DAPO's, keeping only groups whose rewards differ),
                 record log π_old (when needed), log π_ref (with a KL) and V_old (PPO's value
                 head), turn rewards (minus β·KL(π_old ‖ π_ref) with loss.kl_in_reward) into
                 advantages (per token by GAE with a value head).
        Phase B  epochs × shuffled minibatches (one optimizer step each) × microbatches
                 (forward/backward, gradients accumulate). The rollout is read-only.
        After Phase B the updated policy is the next step's π_old.

Every preset of the spectrum (on-policy SFT, REINFORCE, GRPO, Dr. GRPO, DAPO, GSPO, RLOO, PPO with
a value head) runs through this same function; the variant was chosen once when `Setup` was built.
"""

from __future__ import annotations

import torch

from grpolab.algo.kl import KL_ESTIMATORS, kl_reward_penalty
from grpolab.rewards.base import combine
from grpolab.batch import Rollout, scatter_rows
from grpolab.grpo.dynamic_sampling import draw_batch
from grpolab.grpo.setup import Setup
from grpolab.grpo.stats import StepRecord, StepStats


def train(s: Setup) -> list[dict]:
    """Runs s.cfg.train.steps GRPO steps from s.start_step; returns the metric rows.

    On several ranks each runs this same loop on its own P / world prompts (whole groups) and its
    share of every minibatch; `s.services.parallel` reduces what must be global (see grpolab.parallel.parallel)."""
    cfg, G = s.cfg, s.cfg.rollout.group_size
    rows = []
    for step in range(s.start_step, cfg.train.steps):
        st = StepStats(step)
        s.seed_step(step)  # sampling and shuffling streams of (seed, rank, step)
        # ---------------- Phase A: rollout. π_old is the current policy; nothing here has a grad.
        with torch.no_grad():  # this rank's groups, generated and scored (rewards: [N] weighted sum)
            batch = draw_batch(s, st)  # with DAPO's dynamic sampling when set; episodes in agent runs
            ro, scores, rewards = batch.rollout, batch.scores, batch.rewards
        with torch.no_grad(), st.timer("logprob"):
            ro = record_logprobs(s, ro)  # before the advantages: a KL in the reward reads them
        with torch.no_grad(), st.timer("score"):
            # the batch-wide statistics of loss.std=batch are summed over the ranks' groups
            combined, penalty = combined_rewards(s, ro, scores)
            shaped = combined if penalty is None else combined - penalty[0].to(combined)  # minus β·KL per sequence
            adv = s.optim.advantage_fn(shaped.view(-1, G), s.services.parallel.all_reduce_sum).flatten()
            ro = ro.replace(rewards=rewards, advantages=adv, loss_mask=s.train_mask(ro, rewards))
            if s.models.critic is not None:  # PPO: per-token advantages and returns by GAE over V_old, β·KL per token
                ro = s.models.critic.advantages(ro, combined, None if penalty is None else penalty[1])
        # ---------------- Phase B: learning on the frozen rollout.
        if s.data.release_sampler:  # FSDP2: the engine's own full copy is idle until the sync below refills it
            s.data.engine.release_weights()
        with st.timer("learn"):
            learn(s, ro, st)
        with st.timer("sync"):  # the next rollout samples π_new (rollout workers: the weights are sent)
            s.data.engine.load_weights(step + 1, s.services.parallel.full_state(s.models.policy))
            st.sync_bytes = getattr(s.data.engine, "last_sync_bytes", 0)
        record = StepRecord.of(ro, batch.items, batch.texts, scores, st.notes, batch.episodes)
        record = StepRecord.merge(s.services.parallel.gather(record))  # every rank's groups, in rank order
        row = st.reduce(s.services.parallel).finish(record, s)
        if s.models.critic is not None:
            row.update(s.models.critic.step_metrics(ro))  # value loss, clipped share, explained variance
        if s.services.rm_refresh is not None:  # every K steps: pairs of recent rollouts labelled, the RMs trained on them
            row.update(s.services.rm_refresh.after_step(step, record))
        s.after_step(step, row, record)
        rows.append(row)
        if s.should_stop():
            break
    return rows


def record_logprobs(s: Setup, ro: Rollout) -> Rollout:
    """Phase A's no-grad passes over every completion token: log π_old, when Phase B needs it
    before its first optimizer step (several minibatches) or loss.kl_in_reward does (else Phase B's
    first minibatch, all rows under π_old, records it), log π_ref with a reference model, and the
    values V_old with a value head (PPO). With rollout.overlap the rollout was sampled by older
    weights (up to K versions): π_old is that behaviour policy, whose log-probs the sampler recorded."""
    if s.cfg.rollout.overlap:  # sampled by an older policy: the ratio is taken against the behaviour policy
        ro = ro.replace(old_logp=ro.sampler_logp)
    elif s.cfg.needs_old_logp_pass:
        ro = ro.replace(old_logp=s.optim.forward.rollout_logprobs(s.models.train_model, ro))
    if s.models.reference is not None:
        with s.models.reference() as ref:
            ro = ro.replace(ref_logp=s.optim.forward.rollout_logprobs(ref, ro))
    if s.models.critic is not None:
        ro = s.models.critic.record_values(ro)
    return ro


def combined_rewards(s: Setup, ro: Rollout, scores: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The rewards the advantages come from, [N] (NaN = every function abstained), and their KL
    penalty; the step's metrics keep the plain weighted sum. The reward functions' scores (name ->
    [N]) combined per loss.multi_objective_aggregation (`rewards.base.combine`); with
    loss.kl_in_reward (verl's use_kl_in_reward) the penalty kl_coef · KL_t(π_old ‖ π_ref) as
    (per sequence [N], per token [N, Lc]) (`algo.kl.kl_reward_penalty` with loss.kl_estimator), else None."""
    lo = s.cfg.loss
    rewards = combine(scores, {fn.name: w for fn, w in s.data.rewards}, lo.multi_objective_aggregation,
                      ro.group_size, lo.std_eps)
    if not lo.kl_in_reward:
        return rewards, None
    return rewards, kl_reward_penalty(ro.old_logp, ro.ref_logp, ro.loss_mask, lo.kl_coef, KL_ESTIMATORS[lo.kl_estimator])


def learn(s: Setup, ro: Rollout, st: StepStats) -> None:
    """epochs × minibatches × microbatches; one optimizer step per minibatch.

    A minibatch is a random draw of rows (of whole groups with model.shared_prompt); its
    microbatches (`s.optim.forward.chunks`) group rows of similar length, so less padding is computed, or,
    padding-free, carry about equal real tokens. The gradient is the minibatch's either way.

    Without a Phase-A old_logp (one minibatch per epoch), epoch 0 forwards every row under π_old
    before its only optimizer step (old = new.detach(), ratio ≡ 1); those log-probs are kept as
    old_logp for the later epochs, so π_old is never forwarded twice.
    """
    cfg, par = s.cfg, s.services.parallel
    n = ro.num_sequences  # this rank's rows: N / world
    for epoch in range(cfg.train.epochs):
        order = s.optim.forward.row_order(n, ro.group_size, s.optim.shuffle_gen)
        for mb, mb_idx in enumerate(order.split(cfg.minibatch_sequences // par.world_size)):
            s.services.progress.phase("learn", f"epoch {epoch + 1}/{cfg.train.epochs} minibatch {mb + 1}/{cfg.minibatches_per_epoch}")
            minibatch = ro.select(mb_idx)
            normalizer = par.all_reduce_sum(s.optim.objective.normalizer(minibatch.loss_mask))  # before any microbatch
            s.optim.optimizer.zero_grad(set_to_none=True)
            loss_sum, logps = 0.0, []
            micros = s.optim.forward.chunks(minibatch, cfg.train.microbatch_size)  # similar lengths, or equal tokens
            for i, micro_idx in enumerate(micros):
                with par.microbatch(s.models.train_model, last=i + 1 == len(micros)):  # gradients sync on the last
                    loss, stats = s.optim.objective(s.models.train_model, minibatch.select(micro_idx), normalizer)
                    par.backward(loss)
                st.add_micro(stats)
                loss_sum += float(loss.detach())
                logps.append(stats["logp"])
            if ro.old_logp is None and epoch + 1 < cfg.train.epochs:  # every row, forwarded under π_old
                ro = ro.replace(old_logp=scatter_rows(logps, mb_idx[torch.cat(micros)], tuple(ro.loss_mask.shape)))
            s.optimizer_step(st, par.sum_floats(loss_sum))  # every rank skips or steps alike
