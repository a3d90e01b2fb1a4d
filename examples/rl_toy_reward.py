"""A minimal RL loop (GRPO-style, `importance_sampling` loss) on a toy reward that a tiny model can learn.

The reward of a completion is the fraction of its tokens that are plain lowercase words (" the", "cat", ...):
a random tiny model emits them about half the time, and a few policy-gradient steps push that up. Each step
samples GROUP_SIZE completions per prompt from the current weights, centres the rewards within each group
(the advantages), and trains on `importance_sampling` with the sampler's logprobs as the behaviour policy.

Run a server first (`uv run -m skyrl_tx.api --base-model tiny-qwen3`), then:
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/rl_toy_reward.py
"""

from __future__ import annotations

import os
import re

import numpy as np
import tinker
from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "tiny-qwen3")
STEPS = int(os.environ.get("STEPS", "12"))
SEED = int(os.environ.get("SEED", "0"))
GROUP_SIZE = int(os.environ.get("GROUP_SIZE", "8"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "8"))
LEARNING_RATE = float(os.environ.get("LEARNING_RATE", "5e-2"))
PROMPTS = ["Tell me a story:", "Write a sentence:", "Say some words:", "Describe the sea:"]
WORD = re.compile(r" ?[a-z]+")

service_client = tinker.ServiceClient()
training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=SEED).result()
tokenizer = training_client.get_tokenizer()
prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def reward(tokens: list[int]) -> float:
    return sum(WORD.fullmatch(tokenizer.decode([t])) is not None for t in tokens) / max(len(tokens), 1)


for step in range(STEPS):
    # Sample from a frozen snapshot of the current weights (on-policy: one snapshot per step).
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED * 1000 + step)
    futures = [sampling_client.sample(types.ModelInput.from_ints(p), GROUP_SIZE, params) for p in prompts]

    data, starts, rewards = [], [], []
    for prompt, future in zip(prompts, futures):
        sequences = future.result().sequences
        group = np.array([reward(s.tokens) for s in sequences])
        rewards.extend(group.tolist())
        for seq, advantage in zip(sequences, group - group.mean()):
            if advantage == 0 or not seq.tokens:
                continue
            tokens = prompt + seq.tokens
            n_prompt = len(prompt) - 1  # targets before the first sampled token carry no signal
            starts.append(n_prompt)
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs=dict(target_tokens=tokens[1:],
                                    logprobs=[0.0] * n_prompt + list(seq.logprobs),
                                    advantages=[0.0] * n_prompt + [float(advantage)] * len(seq.tokens))))

    note = "no update: every group's rewards were equal"
    if data:
        result = training_client.forward_backward(data, "importance_sampling").result()
        training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
        # The sampler and the trainer saw the same weights: their logprobs of the sampled tokens agree.
        diffs = [np.array(d.loss_fn_inputs["logprobs"].tolist()[s:]) - np.array(o["logprobs"].tolist()[s:])
                 for d, o, s in zip(data, result.loss_fn_outputs, starts)]
        note = f"sampler-trainer logprob gap {float(np.mean(np.concatenate(diffs))):+.2e}"
    print(f"step {step}: mean reward {np.mean(rewards):.4f} ({note})", flush=True)
