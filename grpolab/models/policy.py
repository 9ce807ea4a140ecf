"""The policy a config describes: the built-in tiny model or a local HF/GGUF model, with LoRA adapters
when model.lora_rank > 0."""

from __future__ import annotations


def load_policy(cfg):
    """(model, tokenizer) for a Config's model section: the built-in tiny model, or any local HF/GGUF model."""
    m = cfg.model
    if m.name_or_path in ("builtin:tiny", "builtin:tiny-chat"):
        from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
        from grpolab.models.tiny_chat import TOOLS_TEMPLATE, build_char_chat_tokenizer

        chat = m.name_or_path == "builtin:tiny-chat"
        tok = build_char_chat_tokenizer(TOOLS_TEMPLATE) if chat else build_char_tokenizer()
        model = build_tiny_model(tok, hidden_size=m.hidden_size, num_layers=m.num_layers,
                                 num_heads=m.num_heads, seed=cfg.train.seed, **({"max_positions": 2048} if chat else {}))
    else:
        from grpolab.models.loading import load_model

        model, tok = load_model(m.name_or_path, dtype="float32", device=m.device)
    if m.lora_rank > 0:
        from grpolab.models.lora import apply_lora

        model = apply_lora(model, r=m.lora_rank, alpha=m.lora_alpha)
    return model.to(m.device), tok
