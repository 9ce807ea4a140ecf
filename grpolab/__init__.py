"""grpolab: GRPO and the SFT-to-GRPO spectrum."""
__version__ = "0.1.0"
