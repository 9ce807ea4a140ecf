import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (grpolab[lora])")

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from grpolab.models.lora import (  # noqa: E402
    adapter_state_dict,
    apply_lora,
    load_adapter,
    reference_context,
    save_adapter,
)


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 10), generator=g)


def _train_step(model, ids) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_one_step_changes_only_adapters_and_reference_is_the_base():
    model = tiny_qwen2()
    ids = _ids()
    with torch.no_grad():
        base_logits = model(ids).logits
    base_weights = {k: v.clone() for k, v in model.state_dict().items()}

    peft_model = apply_lora(model, r=4, alpha=8)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}

    _train_step(peft_model, ids)

    changed = {n for n, p in peft_model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    # the wrapped base weights are bit-identical to the original model's
    compared = set()
    for name, w in peft_model.get_base_model().state_dict().items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer", "")
        assert torch.equal(w, base_weights[key]), name
        compared.add(key)
    assert compared == set(base_weights)

    with torch.no_grad():
        adapted = peft_model(ids).logits
        with reference_context(peft_model):
            ref = peft_model(ids).logits
        after = peft_model(ids).logits
    assert not torch.allclose(adapted, base_logits)  # the step did move the policy
    torch.testing.assert_close(ref, base_logits)
    torch.testing.assert_close(after, adapted)  # adapters are back on after the block


def test_default_targets_and_all_linear():
    default = apply_lora(tiny_qwen2(), r=2)
    names = {n for n, _ in default.named_parameters() if "lora_A" in n}
    assert names and all(("q_proj" in n or "v_proj" in n) for n in names)
    every = apply_lora(tiny_qwen2(), r=2, target_modules="all-linear")
    names = {n for n, _ in every.named_parameters() if "lora_A" in n}
    assert any("down_proj" in n for n in names) and not any("lm_head" in n for n in names)


def test_adapter_checkpoint_roundtrip(tmp_path):
    model = apply_lora(tiny_qwen2(), r=4)
    ids = _ids()
    _train_step(model, ids)
    state = adapter_state_dict(model)
    assert state and all("lora_" in k for k in state)
    out = save_adapter(model, tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file()
    assert not any(out.glob("*.bin"))

    restored = load_adapter(tiny_qwen2(), out)
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, model(ids).logits)
    for k, v in adapter_state_dict(restored).items():
        torch.testing.assert_close(v, state[k])


def test_bad_arguments():
    with pytest.raises(ValueError, match="lora.r"):
        apply_lora(tiny_qwen2(), r=0)
    with pytest.raises(ValueError, match="target_modules"):
        apply_lora(tiny_qwen2(), target_modules=["no_such_module"])
    with pytest.raises(TypeError, match="apply_lora"):
        with reference_context(tiny_qwen2()):
            pass
