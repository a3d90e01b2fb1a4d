"""Save sampler weights under a name, then sample from that checkpoint in a new process (a new SDK session).

Without arguments the script fine-tunes a LoRA adapter on a few Pig Latin pairs, saves it with
`save_weights_for_sampler(name)`, samples greedily, then runs itself again in a fresh Python process with the
returned `tinker://…/sampler_weights/<name>` path. That process opens its own ServiceClient, creates a
sampling client from the path alone and samples the same prompts: the completions match the trainer's.

Run a server first (`uv run -m skyrl_tx.api --base-model tiny-qwen3`), then:
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/sample_from_checkpoint.py
Sample from any saved sampler checkpoint (only that part runs; --tokenizer takes a Hugging Face id or local
directory, by default the one SamplingClient.get_tokenizer() finds for the base model's name):
    python examples/sample_from_checkpoint.py tinker://<model_id>/sampler_weights/<name> [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import tinker
from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "tiny-qwen3")
STEPS = int(os.environ.get("STEPS", "30"))
LEARNING_RATE = float(os.environ.get("LEARNING_RATE", "5e-3"))
PAIRS = [("banana split", "anana-bay plit-say"), ("donut shop", "onut-day op-shay"), ("rubber duck", "ubber-ray uck-day")]
PARAMS = types.SamplingParams(max_tokens=12, temperature=0.0, stop=["\n"])


def prompt_tokens(tokenizer, english: str) -> list[int]:
    return tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=True)


@contextlib.contextmanager
def service_session():
    """A ServiceClient whose SDK session ends with the block (newer SDKs' ServiceClient is a context manager
    itself; tinker 0.25, which other servers pin, is not)."""
    if not hasattr(tinker.ServiceClient, "__enter__"):  # tinker 0.25: the session ends with the process
        yield tinker.ServiceClient()
        return
    with tinker.ServiceClient() as service_client:
        yield service_client


def ready(client_or_future):
    """SDK 0.38 returns a future of each new client (.result() gives the client; using the future as the client
    is deprecated); tinker 0.25 returned the client itself."""
    return client_or_future.result() if isinstance(client_or_future, tinker.APIFuture) else client_or_future


def greedy_completions(sampling_client, tokenizer) -> dict[str, str]:
    futures = {en: sampling_client.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, en)), 1, PARAMS)
               for en, _ in PAIRS}
    return {en: tokenizer.decode(f.result().sequences[0].tokens) for en, f in futures.items()}


def sample_only(model_path: str, tokenizer_name: str | None) -> None:
    """The second process: nothing but the checkpoint path (and where its tokenizer lives)."""
    with service_session() as service_client:
        sampling_client = ready(service_client.create_sampling_client(model_path=model_path))
        if tokenizer_name:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
        else:
            tokenizer = sampling_client.get_tokenizer()
        print(json.dumps(greedy_completions(sampling_client, tokenizer)))


def train_save_and_resample() -> None:
    with service_session() as service_client:
        training_client = ready(service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0))
        tokenizer = training_client.get_tokenizer()
        data = []
        for english, pig_latin in PAIRS:
            prompt = prompt_tokens(tokenizer, english)
            completion = tokenizer.encode(f" {pig_latin}\n", add_special_tokens=False)
            tokens, weights = prompt + completion, [0] * len(prompt) + [1] * len(completion)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                    loss_fn_inputs=dict(target_tokens=tokens[1:], weights=weights[1:])))
        for step in range(STEPS):
            result = training_client.forward_backward(data, "cross_entropy").result()
            training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
            if step % 5 == 0 or step == STEPS - 1:
                print(f"step {step}: loss {result.metrics['loss:sum']:.4f}", flush=True)

        model_path = training_client.save_weights_for_sampler(name="pig-latin-final").result().path
        print(f"saved sampler checkpoint: {model_path}", flush=True)
        here = greedy_completions(ready(training_client.create_sampling_client(model_path)), tokenizer)
        print(f"this process:  {json.dumps(here)}", flush=True)
        base = greedy_completions(ready(service_client.create_sampling_client(base_model=BASE_MODEL)), tokenizer)
        print(f"base model:    {json.dumps(base)}", flush=True)

        # A brand-new process (and SDK session) that knows only the path.
        # (The tokenizer's directory is passed on: SamplingClient.get_tokenizer() looks the base model's name up on
        # the Hugging Face hub, which knows no local tiny preset.)
        child = subprocess.run([sys.executable, __file__, model_path, "--tokenizer", tokenizer.name_or_path],
                               capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(f"the sampling process failed (exit code {child.returncode}):\n{child.stderr[-3000:]}")
        there = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"new process:   {json.dumps(there)}", flush=True)
        print(f"same completions in both processes: {here == there}")
        print(f"checkpoint differs from the base model: {here != base}")
        if here != there or here == base:
            sys.exit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_path", nargs="?", help="sample only, from this tinker://…/sampler_weights/… path")
    parser.add_argument("--tokenizer", help="Hugging Face id or directory of the tokenizer (sample-only mode)")
    args = parser.parse_args()
    if args.model_path:
        sample_only(args.model_path, args.tokenizer)
    else:
        train_save_and_resample()
