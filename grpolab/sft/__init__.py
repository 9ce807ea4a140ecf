"""Supervised fine-tuning and SFT-sharpening."""
