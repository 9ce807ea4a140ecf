"""LoRA adapters through PEFT, and the reference model for free.

With LoRA the frozen base weights ARE the reference policy π_ref: `reference_context(model)`
switches the adapters off for the KL forward pass, so no second copy of the model is loaded.

    model = apply_lora(model, r=8, alpha=16)          # only adapter weights require grad
    with torch.no_grad(), reference_context(model):
        ref_logits = model(input_ids).logits            # the base model's logits
    save_adapter(model, run_dir / "adapter")            # adapter weights only (safetensors)
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from grpolab.optional import require


def apply_lora(
    model: torch.nn.Module,
    *,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
) -> Any:
    """Wraps a causal LM with LoRA adapters (PEFT `get_peft_model`); returns the PeftModel.

    The base weights are frozen in place (requires_grad=False); the adapters start at B = 0, so
    the wrapped model first computes exactly the base model. target_modules: None = PEFT's default
    for the architecture (q_proj and v_proj for Llama/Qwen2), "all-linear" = every linear layer
    but the output head, or a list of module names.
    """
    peft = require("peft", "lora")
    if r <= 0:
        raise ValueError(f"lora.r: must be a positive rank, got {r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora.dropout: must be in [0, 1), got {dropout}")
    config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"model.lora_targets={target_modules!r} (PEFT's target_modules): {e}") from e


def _check_peft(model: Any, what: str) -> None:
    peft = require("peft", "lora")
    if not isinstance(model, peft.PeftModel):
        raise TypeError(f"{what} needs a model wrapped by apply_lora (a PeftModel), got {type(model).__name__}")


@contextmanager
def reference_context(model: Any) -> Iterator[Any]:
    """Within the block the model computes the base model (adapters disabled): π_ref for the KL.

    Gradients are not disabled here; wrap the reference forward in `torch.no_grad()`. Dropout
    follows the model's train/eval mode as usual.
    """
    _check_peft(model, "reference_context")
    with model.disable_adapter():
        yield model


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The adapter weights only (names as PEFT saves them), detached, on their current device."""
    _check_peft(model, "adapter_state_dict")
    peft = require("peft", "lora")
    return {k: v.detach() for k, v in peft.get_peft_model_state_dict(model).items()}


def save_adapter(model: Any, directory: str | os.PathLike) -> Path:
    """Writes adapter_config.json + adapter_model.safetensors (adapter weights only) to `directory`."""
    _check_peft(model, "save_adapter")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def load_adapter(base_model: torch.nn.Module, directory: str | os.PathLike, *, trainable: bool = False) -> Any:
    """Wraps `base_model` with the adapter saved in `directory` (the inverse of save_adapter)."""
    peft = require("peft", "lora")
    path = Path(directory)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no adapter_config.json in {path}")
    from grpolab.models.loading import read_weights

    return read_weights("LoRA adapter", path, lambda: peft.PeftModel.from_pretrained(base_model, path,
                                                                                      is_trainable=trainable))
