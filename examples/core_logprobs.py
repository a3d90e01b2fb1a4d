"""Scores a sentence under the base model and under a fresh LoRA adapter, straight on the C++ core.

Run: python examples/core_logprobs.py [--base-model tiny-qwen3]
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer

from skyrl_tx.backend.native import NativeBackend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--text", default="The quick brown fox jumps over the lazy dog.")
    args = parser.parse_args()

    backend = NativeBackend.from_name(args.base_model)
    tokenizer = AutoTokenizer.from_pretrained(backend.model_dir)
    tokens = tokenizer.encode(args.text, add_special_tokens=False)
    backend.create_adapter("demo", rank=8, alpha=16, seed=0)

    base, adapted = backend.token_logprobs([tokens[:-1]] * 2, [tokens[1:]] * 2, ["", "demo"])
    print(f"{len(tokens)} tokens; total logprob base={base.sum():.4f} fresh-adapter={adapted.sum():.4f}")
    # A fresh adapter (B = 0) must equal the base model exactly.
    assert bool((base == adapted).all()), "a fresh LoRA adapter should not change the model"
    for token, lp in zip(tokens[1:], base.tolist()):
        print(f"{tokenizer.decode([token])!r:>12} {lp:8.4f}")


if __name__ == "__main__":
    main()
