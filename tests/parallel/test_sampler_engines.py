"""Disaggregated placement through the real SDK: a server with `colocate_all: false` samples on two sampler engine
processes, kept current by weight syncs over c10d (Gloo), and gives what a colocated server gives (greedy and
seeded tokens, their logprobs to 1e-6): two LoRA tenants and a full fine-tune, three versions each, where every
version's sampling client, asked again after later versions were synced, still samples its own version; also beside
a data-parallel trainer. Every process that computes (the engine, its ranks, the sampler engines and theirs) sizes its
torch thread pools to its share of the cores."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
from live_server import live_server

# (inference_engine_devices: placed explicitly; on a GPU node, e.g. ["cuda:4", "cuda:6"])
DISAGGREGATED = {"colocate_all": False, "generator.inference_engine.num_engines": 2, "max_full_models": 1,
                 "inference_engine_devices": ["cpu", "cpu"]}
COLOCATED = {"max_full_models": 1}
# The thread policy decides in every server process here, as it does for a user who sets nothing (the test runner's
# OMP_NUM_THREADS would be an explicit count every process keeps; an empty one is not).
POLICY_ENV = {"OMP_NUM_THREADS": ""}
THREADS_LINE = re.compile(r"torch runs (\d+) intra-op / (\d+) inter-op threads \(pid (\d+)\)")
VERSIONS = 3
PROMPT = [5, 17, 3, 250, 41, 9]


def _run(url) -> dict[str, Any]:
    import tinker
    from tinker import types

    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-sampler", TINKER_TELEMETRY="0")
    out: dict[str, Any] = {}
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    seeded = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    prompt = types.ModelInput.from_ints(PROMPT)

    def sample(client, params, n=1) -> list[tuple[list[int], list[float]]]:
        result = client.sample(prompt, n, params).result()
        return [(list(s.tokens), [float(x) for x in s.logprobs]) for s in result.sequences]

    with tinker.ServiceClient() as service:
        base = service.create_sampling_client(base_model="tiny-qwen3")
        base = base.result() if hasattr(base, "result") else base
        out["base"] = sample(base, greedy)
        for name, rank in (("a", 4), ("b", 8), ("full", 0)):
            client = service.create_lora_training_client(base_model="tiny-qwen3", rank=rank, seed=len(name)).result()
            samplers = []
            for version in range(VERSIONS):
                data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5 + i, 5 + i + n))),
                                    loss_fn_inputs={"target_tokens": list(range(6 + i, 6 + i + n)),
                                                    "weights": [1.0] * n}) for i, n in enumerate([9, 4, 13])]
                client.forward_backward(data, "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=1e-3 if rank == 0 else 1e-2)).result()
                samplers.append(client.save_weights_and_get_sampling_client().result())
                out[f"{name}@{version}"] = sample(samplers[-1], greedy) + sample(samplers[-1], seeded, n=2)
            for version, sampler in enumerate(samplers):  # older versions, after the newer ones were synced
                out[f"{name}@{version} again"] = sample(sampler, greedy)
    return out


def _unseeded_samples(url) -> list[tuple[int, ...]]:
    """Eight unseeded requests of the base model at once (least busy first: both engines take some)."""
    import tinker
    from tinker import types

    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-sampler", TINKER_TELEMETRY="0")
    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    with tinker.ServiceClient() as service:
        base = service.create_sampling_client(base_model="tiny-qwen3").result()
        futures = [base.sample(types.ModelInput.from_ints(PROMPT), 1, params) for _ in range(8)]
        return [tuple(f.result().sequences[0].tokens) for f in futures]


# The trainer's layout, and (last) sampler engines of two tensor-parallel ranks each beside a one-process trainer
# (colocated, that key does nothing: a warning).
TRAINER_LAYOUTS = {"one-trainer-rank": {}, "two-data-parallel-ranks": {"fully_sharded_data_parallel_size": 2},
                   "two-tensor-parallel-ranks": {"tensor_parallel_size": 2},
                   # and each engine's KV cache sized by a token budget (2 rows of the default 2048 tokens)
                   "tensor-parallel-sampler-engines": {"generator.inference_engine.tensor_parallel_size": 2,
                                                       "kv_cache_tokens": 4096}}


@pytest.fixture(scope="module", params=list(TRAINER_LAYOUTS))
def trainer_layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def colocated(preset_cache, trainer_layout: str) -> dict[str, Any]:
    """The reference: a colocated server with the same trainer layout (parallel training sums gradients in another
    order than one process: its weights agree to 1e-5, not bit for bit)."""
    with live_server(backend_config={**COLOCATED, **TRAINER_LAYOUTS[trainer_layout]}, env=POLICY_ENV) as url:
        return _run(url)


def _assert_each_process_takes_its_share_of_the_cores(url, engine_pid: int, tree: list[int]) -> None:
    """The engine and every process spawned below it report the threads torch runs in them (their log line, with
    their pid): an equal share of the cores less the API's, so together they do not oversubscribe the machine.
    Before, only the engine chose; each child kept its count, N processes running N x (cores - 1) threads."""
    def spawned(pid: int) -> bool:  # a rank or sampler engine, not multiprocessing's resource tracker
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"spawn_main" in f.read()
        except OSError:
            return False

    computing = [pid for pid in tree if pid == engine_pid or spawned(pid)]
    log = url.log_tail(4000)
    reported = {int(m[3]): (int(m[1]), int(m[2])) for m in THREADS_LINE.finditer(log)}
    share = max(1, (len(os.sched_getaffinity(0)) - 1) // len(computing))
    assert {pid: reported.get(pid) for pid in computing} == {pid: (share, 1) for pid in computing}, \
        [line for line in log.splitlines() if "torch runs" in line]


def test_sampler_engines_sample_what_a_colocated_server_samples(preset_cache, colocated, trainer_layout: str) -> None:
    """Also with the trainer as 2 data-parallel or 2 tensor-parallel ranks: the sync group is a group of its own
    beside theirs, and a tensor-parallel trainer's parts reach the engines whole."""
    from engine_processes import assert_all_exit, process_tree

    from skyrl_tx.bench.api import _engine_pid

    config = {**DISAGGREGATED, **TRAINER_LAYOUTS[trainer_layout]}
    with live_server(backend_config=config, env=POLICY_ENV) as url:
        engine_group = process_tree(_engine_pid(url))  # the engine, its sampler engines and their ranks
        _assert_each_process_takes_its_share_of_the_cores(url, _engine_pid(url), engine_group)
        assert "sampling on 2 sampler engine(s)" in url.log_tail(), url.log_tail()
        engine_ranks = 2 if trainer_layout == "tensor-parallel-sampler-engines" else 1
        assert f"of {engine_ranks} tensor-parallel rank(s) each" in url.log_tail(), url.log_tail()
        rows = 2 if trainer_layout == "tensor-parallel-sampler-engines" else 16  # kv_cache_tokens 4096, or the default
        assert f"a KV cache of {rows} rows of 2048 tokens" in url.log_tail(), url.log_tail()
        parallel_trainer = trainer_layout in ("two-data-parallel-ranks", "two-tensor-parallel-ranks")
        assert not parallel_trainer or "parallel: 2 ranks" in url.log_tail(), url.log_tail()
        got = _run(url)
        syncs = [line for line in url.log_tail(2000).splitlines() if "weight sync " in line]
        unseeded = _unseeded_samples(url)
    assert_all_exit(engine_group)  # a stopped server leaves no sampler engine (nor its ranks) behind
    # Every save_weights_and_get_sampling_client reached both engines through a sync (each rank of a
    # tensor-parallel engine in the sync group itself), and both engines served.
    assert len(syncs) == 3 * VERSIONS, syncs
    assert all(f"to 2 sampler engine(s) ({2 * engine_ranks} ranks)" in line for line in syncs), syncs
    served = [int(n) for n in syncs[-1].rsplit("[", 1)[1].rstrip("]").split(",")]
    assert len(served) == 2 and min(served) > 0, syncs[-1]
    assert set(got) == set(colocated)
    # Every engine's own stream starts at the same seed: unseeded requests get theirs from the trainer's one stream,
    # or two engines would draw the same "random" samples.
    assert len(set(unseeded)) == len(unseeded), unseeded
    for key, sequences in colocated.items():
        assert len(got[key]) == len(sequences), key
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got[key], sequences):
            assert tokens == want_tokens, key
            assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) <= 1e-6, key
    for name in ("a", "b", "full"):
        assert colocated[f"{name}@0"] != colocated[f"{name}@{VERSIONS - 1}"], name  # the versions differ
        for version in range(VERSIONS):
            again, again_logprobs = got[f"{name}@{version} again"][0]
            first, first_logprobs = got[f"{name}@{version}"][0]
            assert again == first, (name, version)
            assert max(abs(a - b) for a, b in zip(again_logprobs, first_logprobs)) <= 1e-6, (name, version)


# (a kill with LoRA versions only: tests/parallel/test_sampler_engine_replacement.py, which also holds the replacement)
@pytest.mark.parametrize("fault,full_version,engine_ranks", [("hung", False, 1), ("killed", True, 1),
                                                             ("killed", True, 2)])
def test_a_sampler_engine_lost_in_a_burst_loses_no_request(preset_cache, fault: str, full_version: bool,
                                                           engine_ranks: int) -> None:
    """kill -9 (or SIGSTOP: hung, silent past inference_engine_timeout_s) of a sampler engine while 200 sample
    requests run: the requests it had run again on the other engine at once, so all 200 complete, each with the
    tokens the same request gets once things are calm again; a fresh engine replaces it (loading in the background),
    catches up on every live version (a LoRA one; with full_version also a full fine-tune's, read back from the
    trainer) and serves; the engine process itself goes on. With engines of
    2 tensor-parallel ranks, the killed engine's worker goes with it, and the other engine's two ranks both join the
    new sync group."""
    import signal

    import tinker
    from engine_processes import assert_all_exit, process_tree, spawned_children
    from tinker import types

    from skyrl_tx.bench.api import _engine_pid

    prompts_for_full = types.ModelInput.from_ints([9, 8, 7, 6])
    config = {**DISAGGREGATED, "inference_engine_timeout_s": 3.0, "inference_engine_tensor_parallel_size": engine_ranks}
    with live_server(backend_config=config) as url:
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-sampler", TINKER_TELEMETRY="0")
        with tinker.ServiceClient() as service:
            client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
            data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 14))),
                                loss_fn_inputs={"target_tokens": list(range(6, 15)), "weights": [1.0] * 9})]
            client.forward_backward(data, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            sampler = client.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=6, temperature=0.0)
            full_tokens = []
            if full_version:  # a full fine-tune's version, sampled before the loss and after the replacement
                full = service.create_lora_training_client(base_model="tiny-qwen3", rank=0, seed=2).result()
                full.forward_backward(data, "cross_entropy").result()
                full.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                full_sampler = full.save_weights_and_get_sampling_client().result()
                full_tokens.append(list(full_sampler.sample(prompts_for_full, 4, params).result().sequences[0].tokens))
            prompts = [types.ModelInput.from_ints([5 + i % 50, 17, 3 + i % 7]) for i in range(200)]
            engine = _engine_pid(url)
            samplers = spawned_children(engine)
            assert len(samplers) == 2, samplers
            futures = [sampler.sample(p, 1, params) for p in prompts[:100]]
            os.kill(samplers[0], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            futures += [sampler.sample(p, 1, params) for p in prompts[100:]]
            burst = [list(f.result(timeout=300).sequences[0].tokens) for f in futures]
            restarted = _engine_pid(url) != engine
            # The replacement loads in the background and is admitted at a sample step once it holds the model.
            for _ in range(500):  # a bound, so a replacement never admitted fails the test instead of hanging it
                if "replaced sampler engine(s)" in url.log_path.read_text(errors="replace"):
                    break
                sampler.sample(prompts[0], 1, params).result(timeout=300)
            calm = [list(f.result(timeout=300).sequences[0].tokens)
                    for f in [sampler.sample(p, 1, params) for p in prompts]]
            if full_version:  # 6 at once: the least busy engine takes each, so the fresh one serves some
                full_futures = [full_sampler.sample(prompts_for_full, 1, params) for _ in range(6)]
                full_tokens += [list(f.result(timeout=300).sequences[0].tokens) for f in full_futures]
        engine_group = process_tree(_engine_pid(url))  # with the replacement engine and its ranks
        log = url.log_path.read_text(errors="replace")
    assert_all_exit(engine_group)
    assert burst == calm
    assert not restarted, log[-3000:]
    assert ("is hung" in log) == (fault == "hung"), log[-3000:]
    assert "replaced sampler engine(s) {0: " in log or "replaced sampler engine(s) {1: " in log, log[-3000:]
    assert len(set(map(tuple, full_tokens))) <= 1, full_tokens  # the full version is the same on the fresh engine


def test_streaming_from_a_sampler_engine_follows_its_decode_steps(preset_cache) -> None:
    """The OpenAI endpoint's stream: true relays a sampler engine's progress step by step: with n=2 the choices'
    chunks interleave, and each choice's chunks join to the non-streamed text."""
    import openai

    with live_server(backend_config=DISAGGREGATED) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="tml-sampler", max_retries=0, timeout=120)
        args = {"model": "tiny-qwen3", "prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 123, "n": 2}
        whole = client.completions.create(**args)
        chunks = list(client.completions.create(**args, stream=True))
    order = [c.choices[0].index for c in chunks if c.choices and c.choices[0].text]
    for choice in whole.choices:
        streamed = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == choice.index)
        assert streamed == choice.text, choice.index
    assert all(len(c.text) > 10 for c in whole.choices), "short answers: the interleaving is not exercised"
    assert order != sorted(order), f"choices came one after the other, not per decode step: {order}"


def test_rl_steps_keep_every_sampler_engine_bit_identical_to_the_trainer(preset_cache) -> None:
    """Five RL-style steps (train, ephemeral sync, sample): with weight_sync_digests every sync's weights hash the
    same on the trainer and on both sampler engines, and the sampled tokens' logprobs equal a forward pass of the
    trainer's model over them to 1e-5. The session's request timings give each sample its compute boundary."""
    import re
    from datetime import datetime

    import httpx
    import tinker
    from tinker import types

    with live_server(backend_config={**DISAGGREGATED, "weight_sync_digests": True}) as url:
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-sampler", TINKER_TELEMETRY="0")
        with tinker.ServiceClient() as service:
            client = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=2).result()
            data = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                                loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})]
            for step in range(5):
                client.forward_backward(data, "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                sampler = client.save_weights_and_get_sampling_client().result()
                result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                                        types.SamplingParams(max_tokens=8, temperature=1.0, seed=step)).result()
                data = []
                for seq in result.sequences:
                    tokens = PROMPT + list(seq.tokens)
                    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                        loss_fn_inputs={"target_tokens": tokens[1:],
                                                        "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * len(seq.tokens)})
                    forward = client.forward([datum], "cross_entropy").result()
                    trainer = forward.loss_fn_outputs[0]["logprobs"].tolist()[len(PROMPT) - 1:]
                    assert max(abs(a - b) for a, b in zip(seq.logprobs, trainer)) <= 1e-5, step
                    data.append(datum)  # the next step trains on what was sampled
            # The session trace's phases of the samples the sampler engines computed: each has its compute boundary
            # (computed: when the trainer's engine received the finished sample), between claimed and completed.
            timings = httpx.get(f"{url}/api/v1/sessions/{service.holder.get_session_id()}/request_timings",
                                headers={"X-API-Key": "tml-sampler"}, timeout=60).json()["requests"]
        log = url.log_path.read_text(errors="replace")
    samples = [{k: datetime.fromisoformat(v) for k, v in r["times"].items() if v is not None}
               for r in timings if r["request_type"] == "sample"]
    assert len(samples) == 5, [r["request_type"] for r in timings]
    assert all("computed" in t and t["claimed"] <= t["computed"] <= t["completed"] for t in samples), samples
    digests = re.findall(r"weight sync (\d+) digest: trainer (\w+), sampler engines \['(\w+)', '(\w+)'\]", log)
    assert len(digests) == 5, log[-3000:]
    assert all(trainer == a == b for _, trainer, a, b in digests), digests
    assert len({trainer for _, trainer, _, _ in digests}) == 5  # every step synced new weights
