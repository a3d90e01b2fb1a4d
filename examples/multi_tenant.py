"""Several tenants train their own LoRA adapters on one server at the same time, and sample while they train.

Each tenant is a separate user: its own ServiceClient (session) in its own thread, its own LoRA adapter on the
shared base model, and its own task: answer "Who are you?" with its own name. The server batches the tenants'
forward_backward and sampling requests together; the adapters stay isolated, so at the end every tenant's
greedy sample is its own name, while the base model answers none of them.

Run a server first (`uv run -m skyrl_tx.api --base-model tiny-qwen3`), then:
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/multi_tenant.py
"""

from __future__ import annotations

import os
import sys
import threading

import tinker
from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "tiny-qwen3")
TENANTS = os.environ.get("TENANTS", "alice,bob,carol").split(",")
STEPS = int(os.environ.get("STEPS", "40"))
SAMPLE_EVERY = int(os.environ.get("SAMPLE_EVERY", "10"))
LEARNING_RATE = float(os.environ.get("LEARNING_RATE", "3e-3"))
PROMPT = "Q: Who are you?\nA:"
PARAMS = types.SamplingParams(max_tokens=6, temperature=0.0, stop=["\n"])

lock = threading.Lock()
answers: dict[str, str] = {}
tokenizers: list = []


def log(tenant: str, message: str) -> None:
    with lock:
        print(f"[{tenant:>6}] {message}", flush=True)


def tenant(name: str, rank: int) -> None:
    with tinker.ServiceClient() as service_client:
        training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=0).result()
        tokenizer = training_client.get_tokenizer()
        tokenizers.append(tokenizer)
        prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
        completion = tokenizer.encode(f" {name}\n", add_special_tokens=False)
        tokens, weights = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs=dict(target_tokens=tokens[1:], weights=weights[1:]))
        for step in range(1, STEPS + 1):
            # Pipelined: both requests are queued before waiting; the server runs them in order.
            fwd = training_client.forward_backward([datum], "cross_entropy")
            opt = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
            loss = fwd.result().metrics["loss:sum"]
            opt.result()
            if step % SAMPLE_EVERY == 0 or step == STEPS:
                sampler = training_client.save_weights_and_get_sampling_client().result()
                out = sampler.sample(types.ModelInput.from_ints(prompt), 1, PARAMS).result()
                answer = tokenizer.decode(out.sequences[0].tokens).strip()
                log(name, f"step {step:3d}: loss {loss:8.4f}, answers {answer!r}")
        answers[name] = answer


threads = [threading.Thread(target=tenant, args=(name, 4 * (1 + i % 2)), name=name) for i, name in enumerate(TENANTS)]
for t in threads:
    t.start()
for t in threads:
    t.join()

ok = len(answers) == len(TENANTS) and all(answers[name] == name for name in TENANTS)
print(f"every tenant answers with its own name: {ok}")
with tinker.ServiceClient() as service_client:  # the base model, untouched by the tenants' training
    base = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    tokenizer = tokenizers[0]
    out = base.sample(types.ModelInput.from_ints(tokenizer.encode(PROMPT, add_special_tokens=True)), 1, PARAMS)
    base_answer = tokenizer.decode(out.result().sequences[0].tokens).strip()
print(f"the base model answers {base_answer!r}: none of the names: {base_answer not in TENANTS}")
sys.exit(0 if ok and base_answer not in TENANTS else 1)
