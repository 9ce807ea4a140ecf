"""HFEngine with rollout.bf16_weights (sampling from a per-call bfloat16 copy of the policy); the Engine protocol."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rollout.hf import HFEngine

PROMPTS = ["12+7=", "3-1=", "99+99="]


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer()
    return build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0), tok


def test_bf16_weights_samples_from_the_bf16_copy_and_restores_the_policy(tiny):
    model, tok = tiny
    model.train()

    def generate(policy, bf16_weights):
        eng = HFEngine(tok, max_new_tokens=10, compute_dtype=torch.bfloat16, bf16_weights=bf16_weights)
        return eng.generate_with(policy, PROMPTS, 2, generator=torch.Generator().manual_seed(0))

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


def test_hf_engine_follows_the_engine_protocol_and_samples_from_its_policy(tiny):
    """`generate` samples from the bound policy (the same tokens as `generate_with`); `load_weights`
    of the policy's own state records the version only; other tensors are copied in."""
    from grpolab.rollout.engine import Engine

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    eng = HFEngine(tok, max_new_tokens=6, model=model)
    assert isinstance(eng, Engine)
    got = eng.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    want = eng.generate_with(model, PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got.input_ids, want.input_ids) and len(eng.decode(got)) == 6
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng.load_weights(1, model.state_dict())
    assert eng.weight_version == 1 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    other = {k: torch.zeros_like(v) for k, v in before.items()}
    eng.load_weights(2, other)
    assert eng.weight_version == 2 and all(bool((v == 0).all()) for v in model.state_dict().values())


def test_prompts_are_left_padded_whatever_the_tokenizers_padding_side(tiny):
    """A tokenizer that pads on the right (SmolLM2's does) still gives left-padded prompts, so each
    row's first token comes from its own last prompt token: a batch of prompts of different lengths
    decodes greedily as each prompt alone does."""
    model, tok = tiny
    right = copy.deepcopy(tok)
    right.padding_side = "right"
    engine = HFEngine(right, max_new_tokens=6, model=model)
    prompts = ["7+5=", "12+30=", "1="]
    ids, am = engine.encode_prompts(prompts, "cpu")
    assert am[:, -1].all() and not am[:, 0].all()  # every prompt ends in the last column
    batch = engine.decode(engine.generate(prompts, 1, greedy=True))
    alone = [engine.decode(engine.generate([p], 1, greedy=True))[0] for p in prompts]
    assert batch == alone


def test_an_engines_own_copy_is_freed_until_load_weights_fills_it_again(tiny):
    """FSDP2's sampling copy: release_weights frees its storage (tied weights once), generate refuses
    until load_weights, which restores every tensor; samples then equal the source policy's."""
    from grpolab.models.loading import frozen_copy

    model, tok = tiny
    eng = HFEngine(tok, max_new_tokens=6, model=frozen_copy(model))
    before = eng.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    eng.release_weights()
    assert all(p.untyped_storage().nbytes() == 0 for p in eng.model.parameters())
    with pytest.raises(RuntimeError, match="load_weights"):
        eng.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    eng.load_weights(1, model.state_dict())
    for name, p in eng.model.state_dict().items():
        assert torch.equal(p, model.state_dict()[name]), name
    after = eng.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(after.input_ids, before.input_ids) and eng.weight_version == 1
