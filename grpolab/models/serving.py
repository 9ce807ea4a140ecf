"""What transformers serves: an exported folder loaded with `AutoTokenizer` / `AutoModelForCausalLM` must
tokenize and compute as grpolab did.

transformers 5 loads the tokenizer of a folder whose model_type is one of its
`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` (qwen2 among them) as that model's own class whatever
tokenizer_config.json says: Qwen2Tokenizer, which swaps in its byte-level pre-tokenizer, so a
character-level tokenizer (grpolab's built-in ones, or a user's) loses spaces and newlines and the model
answers a different prompt. A Qwen2 model is the same function as a Llama with attention biases (q, k, v
as Qwen2's, o_proj's zero), whose folder AutoTokenizer loads as saved; `make_servable` writes it so when
the round trip would change the ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

PROBE = "The quick brown fox: 12+34=46, 7/0=cannot.\n\tOK?"


def autotokenizer_matches(folder: Path, tokenizer) -> bool:
    """Whether `AutoTokenizer.from_pretrained(folder)` encodes as `tokenizer` does (a probe text, and the
    chat template's rendering of a short conversation when it has one)."""
    from transformers import AutoTokenizer

    texts = [PROBE, "".join(t for t in tokenizer.get_vocab() if t not in tokenizer.all_special_tokens)]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": "Hi there,\nhow are you?"}]
        texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    try:
        served = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        return all(served(t)["input_ids"] == tokenizer(t)["input_ids"] for t in texts)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot even encode the text (e.g. no [UNK]): no match
        return False


def qwen2_as_llama(model) -> torch.nn.Module:
    """The Llama (attention_bias=True, o_proj bias 0) computing what Qwen2 `model` computes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    qc = model.config
    head_dim = getattr(qc, "head_dim", None) or qc.hidden_size // qc.num_attention_heads
    lc = LlamaConfig(vocab_size=qc.vocab_size, hidden_size=qc.hidden_size, intermediate_size=qc.intermediate_size,
                     num_hidden_layers=qc.num_hidden_layers, num_attention_heads=qc.num_attention_heads,
                     num_key_value_heads=qc.num_key_value_heads, hidden_act=qc.hidden_act, head_dim=head_dim,
                     max_position_embeddings=qc.max_position_embeddings, rms_norm_eps=qc.rms_norm_eps,
                     rope_parameters=qc.rope_parameters, tie_word_embeddings=qc.tie_word_embeddings,
                     attention_bias=True, bos_token_id=qc.bos_token_id, eos_token_id=qc.eos_token_id,
                     pad_token_id=qc.pad_token_id)
    llama = LlamaForCausalLM(lc).to(next(model.parameters()).dtype)
    state = dict(model.state_dict())
    for key, weight in list(state.items()):
        if key.endswith("self_attn.o_proj.weight"):
            state[key[: -len("weight")] + "bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    llama.load_state_dict(state, strict=True)
    ids = torch.arange(min(16, qc.vocab_size)).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, model(ids).logits)  # the same function, checked
    return llama


def make_servable(model, tokenizer, folder: Path, say: Callable[[str], None] | None = None) -> None:
    """After `model` and `tokenizer` were saved to `folder`: when AutoTokenizer would load a different
    tokenizer there, a Qwen2 model is written again as the equivalent Llama (same weights, same logits),
    whose tokenizer AutoTokenizer loads as saved; another architecture is left as it is and said."""
    if autotokenizer_matches(folder, tokenizer):
        return
    if getattr(model.config, "model_type", "") != "qwen2":
        if say is not None:
            say(f"grpolab: warning: transformers' AutoTokenizer loads a different tokenizer from {folder} than the "
                "one trained with; load it with PreTrainedTokenizerFast.from_pretrained")
        return
    llama = qwen2_as_llama(model)
    llama.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if say is not None:
        say(f"grpolab: {folder}: written as the equivalent LlamaForCausalLM (same weights and logits): "
            "transformers' AutoTokenizer would load a Qwen2 folder's tokenizer as Qwen2Tokenizer, not as trained")
