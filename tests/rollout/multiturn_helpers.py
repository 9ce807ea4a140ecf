"""What the multi-turn rollout tests of this folder share: an environment and a tiny policy."""

from __future__ import annotations

import torch

from grpolab.models.tiny import build_tiny_model


class Countdown:
    """Done after item["turns"] steps (reward 1.0 then); replies "again" until then."""

    def reset(self, item):
        self.left = item["turns"]
        return [{"role": "user", "content": f"Say something {item['turns']} times."}]

    def step(self, message):
        self.left -= 1
        done = self.left <= 0
        return [{"role": "user", "content": "again"}], (1.0 if done else None), done


def tiny_with_eos_bias(tok, eos_bias: float):
    """A 2-layer, 32-wide char Qwen2 whose head adds `eos_bias` to <|im_end|>'s logit."""
    m = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, max_positions=2048, seed=0).eval()
    head = torch.nn.Linear(32, len(tok), bias=True)
    head.weight = m.get_input_embeddings().weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tok.eos_token_id] = eos_bias
    m.lm_head = head
    return m
