"""Held-out evaluation of a policy, best-of-N, and a reward model's pair accuracy on a policy's samples."""
