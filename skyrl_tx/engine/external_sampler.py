"""--external-inference-url: sampling through a vLLM server's OpenAI-compatible API instead of the built-in sampler.

ExternalSampler sends one /v1/completions request per Tinker sample request (HTTP in a small thread pool) and hands
finished results back through the backend's submit_sample / sample_step shape. ExternalSamplingBackend wraps the
native backend for the engine loop: training stays native; each LoRA sampler snapshot is written as a PEFT adapter
directory (which the vLLM server must be able to read: same machine or a shared filesystem) and loaded into vLLM
through its runtime LoRA API with the snapshot id as adapter name, and unloaded when the snapshot is released.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from skyrl_tx.engine.executor import LORA_ALPHA
from skyrl_tx.errors import ConflictError, InvalidArgumentError, SkyrlTxError
from skyrl_tx.types import FailedSample, SampledSequence, SampleRequest, SampleResult

log = logging.getLogger("skyrl_tx.engine")

HTTP_WORKERS = 8  # requests in flight to vLLM at once; vLLM batches them itself
WAIT_S = 0.02  # sample_step waits up to this long for a finished request, so a loop with only samples in flight does not spin


class ExternalInferenceError(SkyrlTxError):
    """The external inference server failed a request (reaches the client as the future's error)."""

    category = "server"


def _base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")



class ExternalSampler:
    """Tinker sample requests → vLLM /v1/completions. `model` names the vLLM model: the base or an adapter name."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = _base_url(url)
        self._http = httpx.Client(timeout=timeout_s)
        self._pool = cf.ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="skyrl-tx-vllm")
        self._ids = itertools.count()
        self._running: dict[cf.Future, int] = {}
        try:
            models = self._get("/v1/models")["data"]
        except ExternalInferenceError as exc:
            raise ExternalInferenceError(f"--external-inference-url {url}: no vLLM answers there ({exc.message}); "
                                         "start it first (README: vLLM as the sampling engine)") from exc
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise ExternalInferenceError(f"--external-inference-url {url}: /v1/models lists no base model")
        self.base_model = bases[0]

    # ---- HTTP ---------------------------------------------------------------------------------------
    def _get(self, path: str) -> dict[str, Any]:
        try:
            response = self._http.get(self.url + path)
        except httpx.HTTPError as exc:
            raise ExternalInferenceError(f"external inference server {self.url}: {exc}") from exc
        return self._checked(response, path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = self._http.post(self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise ExternalInferenceError(f"external inference server {self.url}{path}: {exc}") from exc
        return self._checked(response, path)

    def _checked(self, response: httpx.Response, path: str) -> Any:
        if response.status_code == 400 and path == "/v1/completions":  # vLLM refused what the request asks
            raise InvalidArgumentError(f"sample: the external inference server (vLLM at {self.url}) cannot honour "
                                       f"this request: {_vllm_message(response)}")
        if response.status_code >= 400:
            raise ExternalInferenceError(f"external inference server {self.url}{path}: HTTP "
                                         f"{response.status_code}: {response.text[:500]}")
        try:
            return response.json()
        except json.JSONDecodeError:
            return response.text

    # ---- sampling -----------------------------------------------------------------------------------
    def submit_sample(self, request: SampleRequest, model: str) -> int:
        body = completion_body(request, model)  # raises for what vLLM cannot express, before anything is sent
        sample_id = next(self._ids)
        self._running[self._pool.submit(self._sample, body, request)] = sample_id
        return sample_id

    def _sample(self, body: dict[str, Any], request: SampleRequest) -> SampleResult:
        return sample_result(self.post("/v1/completions", body), request)

    def sample_step(self) -> list[tuple[int, SampleResult]]:
        """Finished requests: their results, or a FailedSample holding what failed them."""
        if not self._running:
            return []
        done, _ = cf.wait(list(self._running), timeout=WAIT_S, return_when=cf.FIRST_COMPLETED)
        finished = []
        for fut in done:
            sample_id = self._running.pop(fut)
            exc = fut.exception()
            if exc is not None and not isinstance(exc, SkyrlTxError):
                exc = ExternalInferenceError(f"external inference server {self.url}: {type(exc).__name__}: {exc}")
            finished.append((sample_id, FailedSample(exc) if exc is not None else fut.result()))
        return finished

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def _vllm_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error") or {}
        return str(error.get("message") or response.text)[:500]
    except (json.JSONDecodeError, AttributeError):
        return response.text[:500]


def completion_body(request: SampleRequest, model: str) -> dict[str, Any]:
    """The /v1/completions body for a Tinker sample request. Every Tinker field maps or is refused; none is dropped."""
    refused = [name for name, asked in (("topk_sample_logprobs", request.topk_sample_logprobs),
                                        ("target_prompt_logprobs", request.target_prompt_token_ids is not None),
                                        ("prompt_alt_tokens_k", request.prompt_alt_tokens_k)) if asked]
    if refused:
        raise InvalidArgumentError(f"sample: {', '.join(refused)} not available with the external inference engine "
                                   "(--external-inference-url); leave it unset, or sample without that engine")
    p = request.sampling_params
    prompt = [int(t) for t in (request.prompt_tokens.tolist() if isinstance(request.prompt_tokens, torch.Tensor)
                                 else request.prompt_tokens)]
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": int(p.max_tokens), "n": int(request.num_samples),
        "temperature": float(p.temperature), "top_p": float(p.top_p), "top_k": int(p.top_k) if p.top_k > 0 else -1,
        "logprobs": 1,  # the sampled token's logprob (vLLM always includes the chosen token)
        "return_token_ids": True,  # the completion as token ids (Tinker's result), not text
        "skip_special_tokens": False, "spaces_between_special_tokens": False,
    }
    if p.seed is not None:
        body["seed"] = int(p.seed)
    if p.stop is not None:
        if len(p.stop) == 0:
            body["ignore_eos"] = True  # Tinker: an explicit empty list disables every stop, EOS included
        elif all(isinstance(s, str) for s in p.stop):
            body["stop"] = list(p.stop)
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in p.stop):
            body["stop_token_ids"] = [int(s) for s in p.stop]
        else:
            raise InvalidArgumentError("sample: sampling_params.stop mixes strings and token ids; pass one kind")
    if request.prompt_logprobs or request.topk_prompt_logprobs:
        # vLLM returns the prompt token's own logprob beside its top-k (0: the prompt token's only).
        body["prompt_logprobs"] = int(request.topk_prompt_logprobs)
    return body


def _chosen_logprob(entry: dict[str, Any] | None, token: int) -> float | None:
    if entry is None:
        return None
    item = entry.get(str(token))
    return None if item is None else float(item["logprob"])


def sample_result(response: dict[str, Any], request: SampleRequest) -> SampleResult:
    """vLLM's completion choices → SampleResult (token ids, their logprobs, stop reasons, prompt logprobs)."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    sequences = []
    for choice in choices:
        tokens = [int(t) for t in choice["token_ids"]]
        # token_logprobs[i]: the logprob of the i-th sampled token (aligned with token_ids)
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(logprobs) != len(tokens):
            raise ExternalInferenceError(f"external inference server: {len(logprobs)} logprobs for "
                                         f"{len(tokens)} sampled tokens")
        reason = "length" if choice.get("finish_reason") == "length" else "stop"
        sequences.append(SampledSequence(tokens, logprobs, reason))
    prompt_logprobs = topk = None
    if request.prompt_logprobs or request.topk_prompt_logprobs:
        prompt = [int(t) for t in (choices[0].get("prompt_token_ids") or list(request.prompt_tokens))]
        entries = choices[0].get("prompt_logprobs") or [None] * len(prompt)
        # prompt_logprobs_last_n: vLLM scores the whole prompt; positions before the last N are None, as asked
        unscored = len(prompt) - request.prompt_logprobs_last_n if request.prompt_logprobs_last_n else 0
        entries = [None if i < unscored else e for i, e in enumerate(entries)]
        if request.prompt_logprobs:
            prompt_logprobs = [_chosen_logprob(e, t) for e, t in zip(entries, prompt)]
        if request.topk_prompt_logprobs:
            k = request.topk_prompt_logprobs
            topk = [None if e is None else
                    [(int(t), float(v["logprob"])) for t, v in sorted(e.items(), key=lambda kv: kv[1]["rank"])][:k]
                    for e in entries]
    return SampleResult(sequences, prompt_logprobs, topk)


PROBE_TOKENS = [5, 17, 300, 42, 7, 99, 12, 64, 8, 250]  # a prompt any real vocabulary covers
PROBE_TOLERANCE = 0.25  # nats: above rounding (1e-3 here) and most bf16 drift; two tiny presets differ by 0.66


FULL_WEIGHTS_REFUSED = ("the external inference engine (--external-inference-url) samples the base model and LoRA "
                        "adapters only: vLLM's OpenAI server has no path to push full fine-tuned weights; sample "
                        "full fine-tuned models without --external-inference-url, or train a LoRA (rank >= 1)")


def _target_modules(peft_state: dict[str, torch.Tensor]) -> list[str]:
    return sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in peft_state if ".lora_A" in name})


def _rank(peft_state: dict[str, torch.Tensor]) -> int:
    return int(next(t.shape[0] for name, t in peft_state.items() if ".lora_A" in name))  # lora_A: [r, in]


class ExternalSamplingBackend:
    """The native backend with sampling handed to an external vLLM (see the module docstring). Every attribute
    not defined here is the native backend's own; only the engine thread calls it."""

    def __init__(self, backend: Any, url: str, adapter_dir: Path | None = None):
        self._backend = backend
        self.sampler = ExternalSampler(url)
        self._adapter_root = Path(adapter_dir or tempfile.mkdtemp(prefix="skyrl_tx-vllm-adapters-"))
        self._adapter_root.mkdir(parents=True, exist_ok=True)
        self._alphas: dict[str, float] = {}  # live model id → its LoRA alpha (PEFT adapter_config needs it)
        self._published: dict[str, Path] = {}  # snapshot id → its adapter directory, loaded in vLLM
        self._in_flight: dict[int, str] = {}  # sample id → the vLLM model it samples
        log.info("sampling through the external inference server %s (base model %s); adapters in %s",
                 self.sampler.url, self.sampler.base_model, self._adapter_root)
        self._check_same_base_model()

    def _check_same_base_model(self) -> None:
        """Warns when vLLM's prompt logprobs of a probe differ from ours: it likely serves another model (a
        warning, not a refusal: another dtype or kernel moves logprobs too, though far less than PROBE_TOLERANCE)."""
        probe = PROBE_TOKENS
        try:
            body = {"model": self.sampler.base_model, "prompt": probe, "max_tokens": 1, "prompt_logprobs": 0}
            entries = self.sampler.post("/v1/completions", body)["choices"][0]["prompt_logprobs"][1:]
            theirs = torch.tensor([_chosen_logprob(e, t) for e, t in zip(entries, probe[1:])], dtype=torch.float32)
        except (SkyrlTxError, KeyError, IndexError, TypeError) as exc:
            log.warning("could not compare vLLM's base model with skyrl_tx's (%s): make sure both serve the same "
                        "model", exc)
            return
        ours = self._backend.token_logprobs([probe[:-1]], [probe[1:]])[0].to(torch.float32)  # [len(probe) - 1]
        diff = float((ours - theirs).abs().max())
        if diff > PROBE_TOLERANCE:
            log.warning("the external inference server's base model %s does not look like skyrl_tx's: prompt "
                        "logprobs of a probe differ by up to %.3f; start vLLM on the same model directory",
                        self.sampler.base_model, diff)

    def __getattr__(self, name: str) -> Any:  # only for what is not defined here
        return getattr(self._backend, name)

    # ---- weights the sampler sees -------------------------------------------------------------------
    def create_model(self, model_id: str, *, lora_rank: int, alpha: float | None = None, **kwargs: Any) -> Any:
        result = self._backend.create_model(model_id, lora_rank=lora_rank, alpha=alpha, **kwargs)
        self._alphas[model_id] = float(alpha if alpha is not None else lora_rank)  # lora_rank 0: full weights
        return result

    def snapshot(self, model_id: str, snapshot_id: str) -> None:
        self._backend.snapshot(model_id, snapshot_id)
        if self._alphas.get(model_id) == 0.0:
            return  # full fine-tuned weights: vLLM cannot take them; sampling them is refused (submit_sample)
        state = self._backend.trainable_state(model_id)  # PEFT-named float32 factors
        if any(".lora_" in name for name in state):
            self._publish_or_undo(snapshot_id, state, self._alphas.get(model_id, LORA_ALPHA))

    def load_snapshot(self, snapshot_id: str, weights: dict[str, torch.Tensor], *, rank: int, alpha: float,
                      **kwargs: Any) -> None:
        self._backend.load_snapshot(snapshot_id, weights, rank=rank, alpha=alpha, **kwargs)
        peft = {k if k.startswith("base_model.model.") else "base_model.model." + k: v for k, v in weights.items()}
        self._publish_or_undo(snapshot_id, peft, alpha)

    def remove_snapshot(self, snapshot_id: str) -> None:
        if snapshot_id in self._in_flight.values():
            raise ConflictError(f"snapshot {snapshot_id!r} still serves samples on the external inference server")
        self._backend.remove_snapshot(snapshot_id)
        if snapshot_id in self._published:
            self._unpublish(snapshot_id)

    def _publish_or_undo(self, snapshot_id: str, peft_state: dict[str, torch.Tensor], alpha: float) -> None:
        """A snapshot vLLM cannot load is not kept: the save fails with vLLM's reason (e.g. a rank above its
        --max-lora-rank) instead of leaving a sampling client that cannot sample."""
        try:
            self._publish(snapshot_id, peft_state, alpha)
        except BaseException:
            self._backend.remove_snapshot(snapshot_id)
            raise

    def _publish(self, snapshot_id: str, peft_state: dict[str, torch.Tensor], alpha: float) -> None:
        """Writes the adapter as PEFT files and loads it into vLLM under the snapshot id."""
        if snapshot_id in self._published:  # an overwrite of a named snapshot: the old version goes first
            self._unpublish(snapshot_id)
        directory = self._adapter_root / hashlib.sha256(snapshot_id.encode()).hexdigest()[:32]
        directory.mkdir(parents=True, exist_ok=True)
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": _rank(peft_state), "lora_alpha": alpha,
                  "target_modules": _target_modules(peft_state), "lora_dropout": 0.0, "bias": "none",
                  "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
                  "modules_to_save": None, "base_model_name_or_path": self.sampler.base_model}
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
        save_file({k: v.contiguous() for k, v in peft_state.items()}, str(directory / "adapter_model.safetensors"))
        body = {"lora_name": snapshot_id, "lora_path": str(directory)}
        try:
            self.sampler.post("/v1/load_lora_adapter", body)
        except ExternalInferenceError:
            # vLLM may still hold this name from an engine that ran before a restart (recovery re-creates the
            # same snapshot ids): unload it and load again; a second refusal is vLLM's answer to this adapter.
            self._unload(snapshot_id)
            try:
                self.sampler.post("/v1/load_lora_adapter", body)
            except ExternalInferenceError as exc:
                shutil.rmtree(directory, ignore_errors=True)
                raise InvalidArgumentError(f"sampler weights {snapshot_id!r}: the external inference server "
                                           f"(vLLM) cannot load this LoRA adapter: {exc.message}") from exc
        self._published[snapshot_id] = directory

    def _unpublish(self, snapshot_id: str) -> None:
        self._unload(snapshot_id)
        shutil.rmtree(self._published.pop(snapshot_id), ignore_errors=True)

    def _unload(self, snapshot_id: str) -> None:
        try:
            self.sampler.post("/v1/unload_lora_adapter", {"lora_name": snapshot_id})
        except ExternalInferenceError:
            log.warning("could not unload adapter %s from %s", snapshot_id, self.sampler.url, exc_info=True)

    # ---- sampling -----------------------------------------------------------------------------------
    def submit_sample(self, request: SampleRequest) -> int:
        weights_id = request.weights_id
        if not weights_id:
            model = self.sampler.base_model
        elif weights_id in self._published:
            model = weights_id
        else:
            raise InvalidArgumentError(f"sample: {weights_id!r}: {FULL_WEIGHTS_REFUSED}")
        sample_id = self.sampler.submit_sample(request, model)
        self._in_flight[sample_id] = weights_id
        return sample_id

    def sample_step(self) -> list[tuple[int, SampleResult]]:
        finished = self.sampler.sample_step()
        for sample_id, _ in finished:
            self._in_flight.pop(sample_id, None)
        return finished
