"""The held-out evaluation during a GRPO run (run.eval_every): a Setup hook that scores the policy greedily
on the held-out prompts by the run's rewards (grpolab.evaluation.evaluate.evaluate_policy, what `grpolab
eval` reports) and adds the figures to the step's metrics row as eval/KEY."""

from __future__ import annotations

from grpolab.evaluation.evaluate import eval_items, evaluate_policy

EVAL_PREFIX = "eval/"


class EvalHook:
    """Evaluates every `cfg.run.eval_every` steps and after the last; the held-out prompts are read when the
    hook is built (before the first step), so a missing data.eval_source is said at once."""

    def __init__(self, setup):
        self.setup = setup
        self.every = setup.cfg.run.eval_every
        self.items = eval_items(setup.cfg, setup.models.tokenizer)

    def __call__(self, step: int, row: dict, record) -> None:
        done, cfg = step + 1, self.setup.cfg
        if done % self.every and done != cfg.train.steps:
            return
        res = evaluate_policy(self.setup.models.policy, self.setup.models.tokenizer, cfg, items=self.items)
        row.update({f"{EVAL_PREFIX}{k}": v for k, v in res.get("greedy", {}).items()
                    if isinstance(v, (int, float))})
