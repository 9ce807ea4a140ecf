"""Data parallelism: torchrun launch, the process group, sharded checkpoints, joining a Ray cluster."""
