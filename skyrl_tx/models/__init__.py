"""Offline tiny-model generation: locally trained tokenizers and random-weight HF model presets."""
