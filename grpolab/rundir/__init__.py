"""Run folders (claimed, never overwritten), checkpoints and export."""
