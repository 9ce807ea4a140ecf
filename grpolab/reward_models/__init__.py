"""Reward models: the model, its training, process RMs, and their refresh during GRPO."""
