"""The GRPO trainer: the loop, its objective and critic, dynamic sampling, overlap, speed decisions, step statistics, setup and run directory."""
