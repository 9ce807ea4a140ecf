"""The sharpening self-reward: log π0(completion | prompt) under a frozen copy of the starting policy.

    rewards: [{name: self_likelihood, weight: 1.0, kwargs: {path: runs/pi0/final, length_normalized: false}}]

Huang et al. 2024, "Self-improvement in language models: the sharpening mechanism": a model's own
sequence likelihood is a verifier-free reward; maximizing it under π0 (best-of-N at inference,
SFT on best-of-N winners, or RL with this reward) "sharpens" π0 towards its most confident answers.

π0 is `path` (an HF folder, or a run directory whose final/ holds one: a `grpolab sft` run, the
demo's pi0/ folder), or an in-memory `model` + `tokenizer` (a frozen copy is taken, so training
the original later does not move the reward). In a config without `path`, `build_rewards` passes
the model that model.name_or_path loads (the starting policy, without LoRA adapters).

Tokenization: the prompt text and the completion text are encoded separately without special
tokens and joined (`data.collate.pack_pairs`), as the rollout encodes the prompt (chat template
already rendered into the prompt text) and appends the generated ids, and as SFT encodes its pairs.
A finished completion is followed by EOS, whose log-prob counts (the rollout's loss mask covers
it); a truncated one (metadata `truncated`) is not. The completion text is re-encoded in its
canonical tokenization, which differs from the sampled ids only when the sampler spelled a token
in pieces (e.g. "cannot" letter by letter with the tiny tokenizer's "cannot" token).

Scores: the sum of the token log-probs (the paper's log π0(y|x)), or their mean when
`length_normalized` (no preference for short completions), at temperature 1. Never abstains; not
a verifier. Other kwargs: `batch_size` (rows per no-grad forward), `device` and `dtype` (how
`path` is loaded: float32 | bfloat16 | auto).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from grpolab.algo.logprobs import sequence_logprob
from grpolab.data.collate import pack_pairs
from grpolab.forward import batched_logprobs


def completion_eos_mask(loss_mask: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
    """The loss mask of pairs packed with EOS, with each unfinished row's EOS (its last counted
    token) dropped. loss_mask: [N, Lc] bool (contiguous from column 0); finished: [N] bool.
    Returns [N, Lc] bool."""
    assert loss_mask.shape[0] == finished.shape[0], f"{tuple(loss_mask.shape)} vs {tuple(finished.shape)}"
    last = loss_mask.sum(-1) - 1  # [N]: column of the EOS
    cols = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    is_eos = cols.unsqueeze(0) == last.unsqueeze(1)
    return loss_mask & ~(is_eos & ~finished.unsqueeze(1))


class SelfLikelihood:
    """log π0(completion | prompt), summed or averaged over the completion's tokens (module docstring)."""

    name = "self_likelihood"
    verifier = False

    def __init__(self, path: str | None = None, length_normalized: bool = False, batch_size: int = 64,
                 device: str = "cpu", dtype: str = "float32", model: Any = None, tokenizer: Any = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"self_likelihood: batch_size must be an integer >= 1, got {batch_size!r}")
        if not isinstance(length_normalized, bool):
            raise ValueError(f"self_likelihood: length_normalized must be true or false, got {length_normalized!r}")
        if (path is None) == (model is None) or (model is None) != (tokenizer is None):
            raise ValueError("self_likelihood: give kwargs.path (the frozen π0: an HF folder or a run directory "
                             "with final/), or model and tokenizer in code")
        self.length_normalized = length_normalized
        self.batch_size = batch_size
        self.path = None
        if model is None:
            from grpolab.models.loading import load_model
            from grpolab.rundir.rundir import model_folder

            self.path = model_folder(path)
            try:
                model, tokenizer = load_model(self.path, dtype=dtype, device=device)
            except (OSError, ValueError) as e:
                raise ValueError(f"self_likelihood: kwargs.path={str(path)!r}: {e}") from None
        else:
            from grpolab.models.loading import frozen_copy

            model = frozen_copy(model)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer

    @torch.no_grad()
    def scores(self, prompts: Sequence[str], completions: Sequence[str], finished: Sequence[bool]) -> torch.Tensor:
        """[N] float32 (CPU): log π0 of each completion (plus EOS where finished), sum or mean,
        in batches of `batch_size` rows."""
        if not (len(prompts) == len(completions) == len(finished)):
            raise ValueError(f"reward {self.name!r}: {len(prompts)} prompts, {len(completions)} completions, "
                             f"{len(finished)} finished flags")
        device = next(self.model.parameters()).device
        out = []
        for s in range(0, len(prompts), self.batch_size):
            ro = pack_pairs(self.tokenizer, prompts[s:s + self.batch_size], completions[s:s + self.batch_size])
            ro = ro.replace(input_ids=ro.input_ids.to(device), attention_mask=ro.attention_mask.to(device),
                            loss_mask=ro.loss_mask.to(device))
            mask = completion_eos_mask(ro.loss_mask, torch.tensor(list(finished[s:s + self.batch_size]), device=device))
            lp = batched_logprobs(self.model, ro, 1.0, self.batch_size)  # [n, Lc]
            out.append(sequence_logprob(lp, mask, mean=self.length_normalized).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float]:
        finished = [not m.get("truncated", False) for m in metadata]
        return [float(x) for x in self.scores(prompts, completions, finished)]
