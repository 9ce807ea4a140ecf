"""The policy a config describes: the built-in tiny model or a local HF/GGUF model, with LoRA adapters
when model.lora_rank > 0 and gradient checkpointing when model.gradient_checkpointing is set."""

from __future__ import annotations


BUILTIN_MODELS = ("builtin:tiny", "builtin:tiny-chat")


def builtin_tokenizer(name: str):
    """The character tokenizer of a built-in model (`BUILTIN_MODELS`); builtin:tiny-chat's has a chat
    template that renders tools."""
    from grpolab.models.tiny import build_char_tokenizer
    from grpolab.models.tiny_chat import TOOLS_TEMPLATE, build_char_chat_tokenizer

    return build_char_chat_tokenizer(TOOLS_TEMPLATE) if name == "builtin:tiny-chat" else build_char_tokenizer()


def load_policy(cfg):
    """(model, tokenizer) for a Config's model section: the built-in tiny model, or any local HF/GGUF model,
    prepared by `prepare_policy`."""
    m = cfg.model
    if m.name_or_path in BUILTIN_MODELS:
        from grpolab.models.tiny import build_tiny_model

        chat = m.name_or_path == "builtin:tiny-chat"
        tok = builtin_tokenizer(m.name_or_path)
        model = build_tiny_model(tok, hidden_size=m.hidden_size, num_layers=m.num_layers,
                                 num_heads=m.num_heads, seed=cfg.train.seed, **({"max_positions": 2048} if chat else {}))
    else:
        from grpolab.models.loading import load_model

        model, tok = load_model(m.name_or_path, dtype="float32", device=m.device)
    return prepare_policy(model, cfg), tok


def prepare_policy(model, cfg):
    """A loaded causal LM (model.name_or_path's, or one handed to grpolab.api) made the run's policy:
    gradient checkpointing (model.gradient_checkpointing: transformers' `gradient_checkpointing_enable`,
    non-reentrant, so it works under LoRA, DDP and FSDP2), LoRA adapters (model.lora_rank, lora_alpha,
    lora_dropout, lora_targets), moved to model.device."""
    m = cfg.model
    if m.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            from grpolab.errors import ConfigError

            raise ConfigError(f"model.gradient_checkpointing=true: {type(model).__name__} does not support "
                              "transformers' gradient checkpointing")
        if hasattr(model, "activation_checkpointing_enable"):  # the name transformers 5.x gives it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if m.lora_rank > 0:
        import torch

        from grpolab.models.lora import apply_lora

        targets = list(m.lora_targets) if m.lora_targets else None
        if targets == ["all-linear"]:
            targets = "all-linear"
        with torch.random.fork_rng(devices=[]):  # the adapters' random init from train.seed, not from whatever
            torch.manual_seed(cfg.train.seed)    # the process drew before (the Python API runs several in one)
            model = apply_lora(model, r=m.lora_rank, alpha=m.lora_alpha, dropout=m.lora_dropout,
                               target_modules=targets)
    return model.to(m.device)
