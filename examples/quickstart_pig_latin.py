"""The Tinker README's Pig Latin quickstart, unchanged but for the base model, `ready()` (SDK 0.38 returns a future
of each new client; tinker 0.25 returned the client) and an optional SEED for the LoRA
initialisation, which tests set so that a run is reproducible: SFT with LoRA, then sampling.

Run a server first (`uv run -m skyrl_tx.api --base-model tiny-qwen3`), then:
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/quickstart_pig_latin.py
"""

from __future__ import annotations

import os

import numpy as np
import tinker
from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "tiny-qwen3")
STEPS = int(os.environ.get("STEPS", "6"))
LEARNING_RATE = float(os.environ.get("LEARNING_RATE", "1e-4"))
SEED = int(os.environ["SEED"]) if "SEED" in os.environ else None


def ready(client_or_future):
    """SDK 0.38 returns a future of each new client (.result() gives the client; using the future as the client
    is deprecated); tinker 0.25, which other open servers pin, returned the client itself."""
    return client_or_future.result() if isinstance(client_or_future, tinker.APIFuture) else client_or_future


service_client = tinker.ServiceClient()
training_client = ready(service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=SEED))
tokenizer = training_client.get_tokenizer()

examples = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
    {"input": "donut shop", "output": "onut-day op-shay"},
    {"input": "pickle jar", "output": "ickle-pay ar-jay"},
    {"input": "space exploration", "output": "ace-spay exploration-way"},
    {"input": "rubber duck", "output": "ubber-ray uck-day"},
    {"input": "coding wizard", "output": "oding-cay izard-way"},
]


def process_example(example: dict, tokenizer) -> types.Datum:
    prompt = f"English: {example['input']}\nPig Latin:"
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
    completion_tokens = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
    tokens = prompt_tokens + completion_tokens
    weights = [0] * len(prompt_tokens) + [1] * len(completion_tokens)
    # The SDK's convention: position i of the input predicts target i (inputs and targets pre-shifted).
    return types.Datum(model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
                       loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]))


processed = [process_example(ex, tokenizer) for ex in examples]
for step in range(STEPS):
    fwdbwd_future = training_client.forward_backward(processed, "cross_entropy")
    optim_future = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
    fwdbwd_result = fwdbwd_future.result()
    optim_future.result()
    logprobs = np.concatenate([out["logprobs"].tolist() for out in fwdbwd_result.loss_fn_outputs])
    weights = np.concatenate([d.loss_fn_inputs["weights"].tolist() for d in processed])
    print(f"step {step}: loss per token {-np.dot(logprobs, weights) / weights.sum():.4f}")

sampling_client = ready(training_client.save_weights_and_get_sampling_client(name="pig-latin-model"))
prompt = types.ModelInput.from_ints(tokenizer.encode("English: coffee break\nPig Latin:"))
params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=8).result()
print("Responses:")
for i, seq in enumerate(result.sequences):
    print(f"{i}: {tokenizer.decode(seq.tokens)!r}")
