"""HFEngine with rollout.bf16_weights: sampling from a per-call bfloat16 copy of the policy."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rollout.hf import HFEngine, weights_copy

PROMPTS = ["12+7=", "3-1=", "99+99="]


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer()
    return build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0), tok


def test_weights_copy_casts_parameters_keeps_ties_and_leaves_the_model_alone(tiny):
    model, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cp = weights_copy(model, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tiny model ties them
    assert cp.lm_head.weight is cp.model.embed_tokens.weight
    for (name, p), (_, q) in zip(model.named_parameters(), cp.named_parameters()):
        assert q.dtype == torch.bfloat16 and not q.requires_grad and p.dtype == torch.float32, name
        torch.testing.assert_close(q, p.detach().to(torch.bfloat16), rtol=0, atol=0)
    for (name, b), (_, c) in zip(model.named_buffers(), cp.named_buffers()):
        assert c.dtype == b.dtype and torch.equal(c, b), name
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters()) and not cp.training


def test_bf16_weights_samples_from_the_bf16_copy_and_restores_the_policy(tiny):
    model, tok = tiny
    model.train()

    def generate(policy, bf16_weights):
        eng = HFEngine(tok, max_new_tokens=10, compute_dtype=torch.bfloat16, bf16_weights=bf16_weights)
        return eng.generate(policy, PROMPTS, 2, generator=torch.Generator().manual_seed(0))

    ro = generate(model, True)
    assert model.training and next(model.parameters()).dtype == torch.float32
    # the same samples and log-probs as generating from a copy with its parameters cast (buffers
    # such as the rotary frequencies stay float32) ...
    cast = copy.deepcopy(model)
    for p in cast.parameters():
        p.data = p.data.to(torch.bfloat16)
    cast = generate(cast, False)
    assert torch.equal(ro.input_ids, cast.input_ids) and torch.equal(ro.loss_mask, cast.loss_mask)
    torch.testing.assert_close(ro.sampler_logp, cast.sampler_logp, rtol=0, atol=0)
    # ... and not those of the float32 weights under autocast (the default)
    plain = generate(model, False)
    assert not torch.equal(ro.sampler_logp, plain.sampler_logp)


def test_bf16_weights_needs_a_bf16_model_dtype():
    from grpolab import config as C

    with pytest.raises(C.ConfigError, match="rollout.bf16_weights"):
        C.from_preset("grpo", ["rollout.bf16_weights=true", "model.dtype=float32"])
    assert C.from_preset("grpo", ["rollout.bf16_weights=true", "model.dtype=bfloat16"]).rollout.bf16_weights
