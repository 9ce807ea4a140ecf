"""A learned reward model as a GRPO reward function: scores `prompt + completion` with a saved RM.

    rewards=[reward_model:1.0]  with kwargs {"path": "runs/x/rm_accuracy"}

The RM folder is written by `grpolab rm` / grpolab.reward_models.model.save_reward_model (any HF
`*ForSequenceClassification` folder with one output works too). A process RM's folder
(grpolab/reward_models/process.py, `"kind": "process"` in grpolab_rm.json) scores each completion by
its weakest step. It is loaded once, when the
reward is built, so a wrong path stops the run before training starts.

Scores are raw RM outputs unless `normalize` says otherwise:
- "batch": z-score over the rows of each call, (s - mean) / (std + 1e-6), population std. One
  call is one GRPO step's P×G completions, so this is a per-step normalization (not per group).
- "fixed": (s - mean) / std with constants: by default `score_mean` / `score_std` from the folder's
  grpolab_rm.json, i.e. the mean and population std of the RM's scores over the chosen and rejected
  completions of its training pairs, measured after RM training; explicit `mean` / `std` override them.
- "calibrated": P(good | s) = σ(a·s + b), the `calibration` (a, b) of grpolab_rm.json: a logistic
  fit of the chosen (good) and rejected (bad) completions of its training pairs.
Each keeps two RMs with different score scales comparable in a weighted sum. `threshold` turns the
(normalized) score into 1.0 above it, else 0.0: with "calibrated" and 0.5 the RM is a learned
verifier, and a group whose completions it judges all wrong gives no advantage, instead of the RM's
arbitrary order among wrong answers (which group normalization would amplify). `clip` (after the
normalization) bounds each score to [-clip, clip]: an RM's extreme scores, where a policy
over-optimizing it is headed, count no more than `clip`. (Group-normalized
advantages remove any per-prompt offset anyway; what the scale changes is the balance between
rewards.) The reward never abstains, and it does not look at the metadata: a truncated completion
is scored like any other text (use the `format` rule reward to penalize truncation explicitly).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from grpolab.algo.calibration import calibrated
from grpolab.reward_models.model import default_append_eos, load_reward_model, score_texts

_NORMALIZE = (None, "none", "batch", "fixed", "calibrated")


class RewardModelReward:
    """Scores with a saved reward model: one float per row (see the module docstring)."""

    name = "reward_model"
    verifier = False

    def __init__(
        self,
        path: str,
        device: str = "cpu",
        batch_size: int = 64,
        normalize: str | None = None,
        mean: float | None = None,
        std: float | None = None,
        clip: float | None = None,
        threshold: float | None = None,
    ):
        if normalize not in _NORMALIZE:
            raise ValueError(f"reward_model: normalize must be one of {_NORMALIZE}, got {normalize!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward_model: batch_size must be an integer >= 1, got {batch_size!r}")
        if clip is not None and not float(clip) > 0:
            raise ValueError(f"reward_model: clip must be > 0 (or null), got {clip!r}")
        self.clip = None if clip is None else float(clip)
        self.threshold = None if threshold is None else float(threshold)
        self.path = str(path)
        self.batch_size = batch_size
        self.normalize = None if normalize == "none" else normalize
        self.model, self.tokenizer, self.info = load_reward_model(path, device)
        self.append_eos = bool(self.info.get("append_eos", default_append_eos(self.tokenizer)))
        self.mean, self.std = self._constants(mean, std)
        self.calibration = self._calibration()

    @classmethod
    def from_model(cls, model, tokenizer, info: dict | None = None, batch_size: int = 64) -> "RewardModelReward":
        """The reward of a reward model in memory (raw scores, not normalized), e.g. one still training."""
        self = cls.__new__(cls)
        self.path, self.model, self.tokenizer, self.info = "<in memory>", model, tokenizer, dict(info or {})
        self.batch_size, self.normalize, self.mean, self.std, self.clip = batch_size, None, 0.0, 1.0, None
        self.threshold, self.calibration = None, None
        self.append_eos = bool(self.info.get("append_eos", default_append_eos(tokenizer)))
        return self

    def _calibration(self) -> torch.Tensor | None:
        if self.normalize != "calibrated":
            return None
        ab = self.info.get("calibration")
        if ab is None:
            raise ValueError(f"reward_model: normalize='calibrated' needs the (a, b) of P(good | s) = σ(a·s + b), and "
                             f"{self.path} has no calibration in grpolab_rm.json (save it with a current grpolab)")
        return torch.tensor(ab, dtype=torch.float64)

    def _constants(self, mean: float | None, std: float | None) -> tuple[float, float]:
        if self.normalize != "fixed":
            return 0.0, 1.0
        mean = self.info.get("score_mean") if mean is None else mean
        std = self.info.get("score_std") if std is None else std
        if mean is None or std is None:
            raise ValueError(f"reward_model: normalize='fixed' needs mean and std, and {self.path} has no "
                             "score_mean/score_std in grpolab_rm.json; pass mean=..., std=...")
        if not float(std) > 0:
            raise ValueError(f"reward_model: normalize='fixed' needs std > 0, got {std}")
        return float(mean), float(std)

    def scores(self, prompts: Sequence[str], completions: Sequence[str]) -> torch.Tensor:
        """Raw RM scores [N] float32 (CPU), in batches of `batch_size`, without grad; a process RM
        (grpolab_rm.json kind "process") gives each completion's weakest step score."""
        if self.info.get("kind") == "process":
            from grpolab.reward_models.process import score_process

            return score_process(self.model, self.tokenizer, prompts, completions, append_eos=self.append_eos,
                                 batch_size=self.batch_size, scorer=self.info.get("step_scorer", "head"))
        return score_texts(self.model, self.tokenizer, prompts, completions,
                           append_eos=self.append_eos, batch_size=self.batch_size)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"reward {self.name!r}: {len(prompts)} prompts but {len(completions)} completions")
        if not completions:
            return []
        s = self.scores(prompts, completions).double()
        if self.normalize == "batch":
            s = (s - s.mean()) / (s.std(correction=0) + 1e-6)
        elif self.normalize == "fixed":
            s = (s - self.mean) / self.std
        elif self.normalize == "calibrated":
            s = calibrated(s, self.calibration)
        if self.clip is not None:
            s = s.clamp(-self.clip, self.clip)
        if self.threshold is not None:
            s = (s > self.threshold).double()
        return [float(x) for x in s]


class RewardModelEnsemble:
    """Several saved reward models as one reward (Coste et al. 2023): each member scores every row,
    normalized to a common scale (`normalize`, as for `reward_model`; "fixed" by default: each member's
    own training-pair statistics), and `algo.ensembles.ENSEMBLES[mode]` turns the [K, N] scores into
    one reward per row: mean, min (worst case), mean_minus_std or mean_minus_var (λ = `lam`).

        {name: reward_model_ensemble, kwargs: {paths: [rm_a, rm_b, rm_c], mode: mean_minus_std, lam: 1.0}}
    """

    name = "reward_model_ensemble"
    verifier = False

    def __init__(self, paths: Sequence[str], mode: str = "mean_minus_std", lam: float = 1.0,
                 normalize: str | None = "fixed", device: str = "cpu", batch_size: int = 64):
        from grpolab.algo.ensembles import ENSEMBLES

        if isinstance(paths, str) or len(paths) < 2:
            raise ValueError(f"reward_model_ensemble: paths must list at least two reward model folders, got {paths!r}")
        if mode not in ENSEMBLES:
            raise ValueError(f"reward_model_ensemble: mode must be one of {sorted(ENSEMBLES)}, got {mode!r}")
        if not float(lam) >= 0:
            raise ValueError(f"reward_model_ensemble: lam must be >= 0, got {lam!r}")
        self.members = [RewardModelReward(str(p), device=device, batch_size=batch_size, normalize=normalize)
                        for p in paths]
        self.combine, self.lam = ENSEMBLES[mode], float(lam)

    def member_scores(self, prompts: Sequence[str], completions: Sequence[str],
                      metadata: Sequence[dict[str, Any]]) -> torch.Tensor:
        """[K, N] float64: each member's (normalized) scores."""
        return torch.tensor([m(prompts, completions, metadata) for m in self.members], dtype=torch.float64)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> list[float]:
        if not completions:
            return []
        return [float(x) for x in self.combine(self.member_scores(prompts, completions, metadata), self.lam)]
