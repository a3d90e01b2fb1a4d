"""Benchmarks: skyrl_tx vs Hugging Face transformers + PEFT (`python -m skyrl_tx.bench`), API overhead (`... api`)."""
