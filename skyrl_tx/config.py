"""BackendSettings: the documented --backend-config keys, validated once at the edge."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

from skyrl_tx.errors import InvalidArgumentError


# Keys of the seed Configuration page accepted as written, and the setting each one is.
SEED_KEYS = {"generator.inference_engine.num_engines": "num_inference_engines",
             "generator.inference_engine.tensor_parallel_size": "inference_engine_tensor_parallel_size",
             "generator.inference_engine.gpu_memory_utilization": "gpu_memory_utilization",
             "trainer.placement.colocate_all": "colocate_all", "generator.colocate_all": "colocate_all",
             "trainer.placement.policy_num_gpus_per_node": "fully_sharded_data_parallel_size",
             # the seed README's: rows decoding at once (its 0, "the whole batch", has no bound here: refused)
             "sample_max_num_sequences": "max_sampling_sequences"}
@dataclass(frozen=True)
class BackendSettings:
    """Compute settings of one base model. Every field is a --backend-config key."""

    max_lora_adapters: int = 8  # adapters live at once (each a slot)
    max_lora_rank: int = 32  # largest LoRA rank a client may ask for
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    device: str = "cpu"  # cpu | cuda | cuda:N
    logprobs_chunk_tokens: int = 1024  # tokens per [tokens, vocab] logits chunk
    seed: int = 0
    max_full_models: int = 1  # full fine-tuning copies (lora_rank=0) live at once
    train_micro_batch_tokens: int = 8192  # tokens per forward/backward micro-batch (padding included)
    # Sequences per micro-batch at most (the seed README's key, same meaning; 0: only train_micro_batch_tokens bounds)
    train_micro_batch_size: int = 0
    gradient_checkpointing: bool = False  # recompute layer activations in backward (less memory)
    # Micro-batches of mixed lengths pack their sequences back to back in one row: varlen attention, no padded work
    # (a Gated DeltaNet layer restarts its state per sequence). False: one right-padded row per sequence.
    train_packed_sequences: bool = True
    max_sampling_sequences: int = 16  # sequences decoding at once (KV cache rows)
    max_sampling_length: int = 2048  # prompt + completion tokens per sampled sequence
    # The KV cache by a budget instead of max_sampling_sequences rows (give one of the three): kv_cache_tokens
    # tokens (rows = kv_cache_tokens // max_sampling_length; any device), or on a GPU the rows that fit in this
    # fraction of the device's memory once the weights are loaded (the seeds' gpu_memory_utilization; C++ core:
    # sampling/kv_budget.h). Each KV cache of the engine (the base model's; a full fine-tune's) gets these rows.
    kv_cache_tokens: int = 0
    gpu_memory_utilization: float = 0.0
    # Largest k a sample request may ask of top-k logprobs (prompt or sampled positions) and alternative draws: each
    # position's k pairs are kept and sent, so k bounds a response's size (hosted Tinker caps it at 20 too).
    max_logprobs_k: int = 20
    # Sampling keeps finished sequences' K/V cache rows and serves a later prompt's matching prefix from them instead
    # of prefilling it again (the base model and snapshots only: their weights never change); rows are reclaimed LRU.
    prefix_caching: bool = True
    # Sampling prompts of mixed lengths prefill back to back in one row (varlen attention, no padded work; a Gated
    # DeltaNet keeps each prompt's state at its end). False: one right-padded row per prompt.
    sample_packed_prefill: bool = True
    max_resident_snapshots: int = 4  # frozen adapter versions in device slots (LRU to host memory beyond)
    cuda_graphs: bool = True  # GPU: capture each decode step shape as a CUDA graph once, then replay it
    num_threads: int = 0  # engine's intra-op threads; 0: from the cores it owns (engine/threads.py)
    # Device time kept for decoding while training also waits (engine/loop.py): after a training pass of T
    # seconds, decode steps run for up to T * share / (1 - share) before the next pass. 0: one step per pass.
    sampling_share: float = 0.5
    # Recovery snapshots (engine/recovery_state.py): weights + AdamW state after every N optim steps or T seconds,
    # so a restart replays only what came after; 0 steps: never. Futures older than the retention are pruned.
    recovery_snapshot_every_steps: int = 50
    recovery_snapshot_every_s: float = 600.0
    futures_retention_hours: float = 24.0
    # Memory for full fine-tuning sampler snapshots (frozen whole-model copies): beyond it the least recently
    # sampled ones move to disk and load back when sampled (engine/snapshot_memory.py). 0: what the device has left
    # once the memory plan's peak is counted (skyrl-tx plan; a bf16 8B full fine-tune's snapshot alone is 16 GB).
    snapshot_memory_mb: int = 0
    # Data parallelism (the seed README's key): ranks on this node, one process each (rank 0 is the engine), each
    # computing its share of every forward_backward's rows by tokens; 1: one process
    # (skyrl_tx/parallel/data_parallel_backend.py). A full fine-tune's gradients and AdamW moments are sharded over
    # the ranks (ZeRO-2, csrc/optim/zero_adamw.h), moved in buckets of zero_bucket_mb float32 MB; LoRA adapters are
    # replicated.
    fully_sharded_data_parallel_size: int = 1
    zero_bucket_mb: int = 256
    # Tensor parallelism (the seed README's key): every model's attention heads, MLP columns and vocabulary split
    # over this many ranks (dense Qwen3 / Llama 3, LoRA; csrc/dist/tensor_parallel.h), each holding its shard of the
    # weights and KV cache. With fully_sharded_data_parallel_size D there are D x T ranks: D replicas of T ranks.
    tensor_parallel_size: int = 1
    # Expert parallelism: 1 keeps the experts whole on every rank; tensor_parallel_size spreads every MoE layer's
    # experts over those ranks (each holds and runs its share; one all-reduce combines them); with
    # tensor_parallel_size 1, fully_sharded_data_parallel_size spreads them over the data-parallel ranks (each
    # token sent to its expert's rank and back, all-to-all; LoRA only).
    expert_parallel_size: int = 1
    # How MoE layers run their experts (csrc/models/stacked_experts.h): "auto" as grouped GEMMs over stacked weights
    # where libtorch has the fast kernel (CUDA bfloat16 on compute capability >= 9.0), else one matmul chain per
    # expert with tokens; "always" grouped wherever libtorch has the op (a CPU runs ATen's reference loop, for
    # tests; CUDA needs bfloat16 on compute capability >= 8.0);
    # "never" per expert. A full fine-tune's trainable experts always run per expert.
    grouped_expert_gemm: str = "auto"
    # Multi-node (skyrl_tx/parallel/layout.py): the ranks spread evenly over num_processes node processes; the
    # engine's node hosts the rendezvous at coordinator_address (HOST:PORT), the others run `skyrl-tx worker`.
    num_processes: int = 1
    coordinator_address: str = ""
    # Placement (the seeds' vocabulary): colocate_all true samples inside the training engine; false runs
    # num_inference_engines sampler engines in processes of their own (skyrl_tx/parallel/sampler_engines.py), on the
    # devices after the trainer's, kept current by weight syncs over c10d.
    colocate_all: bool = True
    num_inference_engines: int = 1
    inference_engine_tensor_parallel_size: int = 1
    # Each sampler engine's (first) device, e.g. ["cuda:4", "cuda:6"] (an engine of T tensor-parallel ranks takes T
    # devices from there); empty: the devices after the trainer's. The trainer's first device is `device`.
    inference_engine_devices: tuple[str, ...] = ()
    # A sampler engine that says nothing this long while it owes results (it reports at least every second while
    # decoding) is taken for hung: it is killed and the engine restarts with fresh ones, as after a crash.
    inference_engine_timeout_s: float = 60.0
    # Debugging: every weight sync is hashed (sha256 of the weights) on the trainer and on every sampler engine and
    # logged; a sampler engine holding other weights fails the save. Costs a pass over the weights per sync.
    weight_sync_digests: bool = False

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_json(cls, text: str | None) -> BackendSettings:
        """Parses the --backend-config JSON object; unknown keys and bad values name the fix."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"--backend-config: not valid JSON ({exc}); pass an object like "
                                       '\'{"max_lora_rank": 64}\'') from exc
        if not isinstance(raw, dict):
            raise InvalidArgumentError("--backend-config: must be a JSON object of keys "
                                       f"{', '.join(cls.valid_keys())}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BackendSettings:
        aliased = [k for k in raw if k in SEED_KEYS]
        duplicate = [k for k in aliased if SEED_KEYS[k] in raw or sum(SEED_KEYS[a] == SEED_KEYS[k] for a in aliased) > 1]
        if duplicate:
            raise InvalidArgumentError(f"--backend-config: {', '.join(sorted(duplicate))} set the same setting as "
                                       "another key given; give it once")
        raw = {SEED_KEYS.get(k, k): v for k, v in raw.items()}  # the seed Configuration page's keys, as written
        unknown = sorted(set(raw) - set(cls.valid_keys()))
        if unknown:
            raise InvalidArgumentError(f"--backend-config: unknown key(s) {', '.join(unknown)}; "
                                       f"valid keys are {', '.join(cls.valid_keys())}")
        defaults = cls()
        for key, value in raw.items():
            expected = type(getattr(defaults, key))
            if expected is float and type(value) is int:  # JSON writes 1.0 as 1
                value = raw[key] = float(value)
            if expected is tuple and type(value) is list and all(type(v) is str for v in value):  # JSON's arrays
                value = raw[key] = tuple(value)
            if type(value) is not expected:
                raise InvalidArgumentError(f"--backend-config: {key} must be of type {expected.__name__} "
                                           f"(got {value!r})")
        cls._size_kv_cache(raw, defaults)
        settings = cls(**raw)
        settings.validate()
        return settings

    @staticmethod
    def _size_kv_cache(raw: dict[str, Any], defaults: BackendSettings) -> None:
        """One of max_sampling_sequences, kv_cache_tokens and gpu_memory_utilization sizes the KV cache;
        kv_cache_tokens sets max_sampling_sequences in `raw`. (A max_sampling_sequences equal to what kv_cache_tokens
        gives is no conflict: settings are passed on to ranks and engines as dicts.)"""
        tokens, fraction = raw.get("kv_cache_tokens", 0), raw.get("gpu_memory_utilization", 0.0)
        rows = raw.get("max_sampling_sequences", defaults.max_sampling_sequences)
        if tokens > 0:  # (negative: validate() says so)
            length = raw.get("max_sampling_length", defaults.max_sampling_length)
            if tokens < max(length, 2):
                raise InvalidArgumentError(f"--backend-config: kv_cache_tokens={tokens} holds less than one sequence "
                                           f"of max_sampling_length={length} tokens: raise kv_cache_tokens or lower "
                                           "max_sampling_length")
            raw["max_sampling_sequences"] = tokens // length
        given = [k for k, on in (("max_sampling_sequences", rows != defaults.max_sampling_sequences
                                  and not (tokens > 0 and rows == raw["max_sampling_sequences"])),
                                 ("kv_cache_tokens", tokens > 0), ("gpu_memory_utilization", fraction > 0)) if on]
        if len(given) > 1:
            raise InvalidArgumentError(f"--backend-config: {' and '.join(given)} each size the KV cache; give one")

    def _validate_engine_devices(self) -> None:
        """inference_engine_devices: one per engine, of the trainer's kind, none shared with the trainer's ranks on
        this node or another engine's ranks."""
        given = self.inference_engine_devices
        if not given:
            return
        where = "--backend-config: inference_engine_devices"
        if self.colocate_all:
            raise InvalidArgumentError(f"{where} places sampler engines, which only colocate_all false starts; set "
                                       "colocate_all false or leave the key out")
        if len(given) != self.num_inference_engines:
            raise InvalidArgumentError(f"{where} names {len(given)} device(s) for num_inference_engines="
                                       f"{self.num_inference_engines}: give one (first) device per engine")
        if self.device == "cpu":
            if any(d != "cpu" for d in given):
                raise InvalidArgumentError(f"{where} must all be 'cpu' when device is 'cpu' (got {list(given)})")
            return
        if not all(d.startswith("cuda:") and d[5:].isdigit() for d in given):
            raise InvalidArgumentError(f"{where} must be 'cuda:N' devices like the trainer's {self.device!r} "
                                       f"(got {list(given)})")
        first = int(self.device.split(":", 1)[1]) if ":" in self.device else 0
        trainer_here = self.fully_sharded_data_parallel_size * self.tensor_parallel_size // max(self.num_processes, 1)
        taken = {i: "the trainer" for i in range(first, first + trainer_here)}
        for engine, device in enumerate(given):
            start = int(device[5:])
            for index in range(start, start + self.inference_engine_tensor_parallel_size):
                if index in taken:
                    raise InvalidArgumentError(f"{where}: sampler engine {engine} would use cuda:{index}, which "
                                               f"{taken[index]} uses; give each engine devices of its own")
                taken[index] = f"sampler engine {engine}"

    @property
    def experts_over_data_parallel(self) -> bool:
        """Expert parallelism over the data-parallel ranks (each holds 1/D of every MoE layer's experts and sends
        each token to its expert's rank) rather than over a replica's tensor-parallel ranks."""
        return (self.tensor_parallel_size == 1 and self.fully_sharded_data_parallel_size > 1
                and self.expert_parallel_size == self.fully_sharded_data_parallel_size)

    def validate(self) -> None:
        if self.kv_cache_tokens < 0:
            raise InvalidArgumentError(f"--backend-config: kv_cache_tokens must be >= 0 (0: max_sampling_sequences "
                                       f"rows; got {self.kv_cache_tokens})")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError(f"--backend-config: gpu_memory_utilization must be in (0, 1] (the fraction "
                                       f"of the GPU's memory this engine may fill; got {self.gpu_memory_utilization})")
        if self.gpu_memory_utilization > 0 and not self.device.startswith("cuda"):
            raise InvalidArgumentError("--backend-config: gpu_memory_utilization sizes the KV cache from a GPU's "
                                       f"memory, but device is {self.device!r}: on a CPU give kv_cache_tokens (or "
                                       "max_sampling_sequences) instead")
        for key in ("recovery_snapshot_every_steps", "recovery_snapshot_every_s", "futures_retention_hours"):
            if not getattr(self, key) >= 0:
                raise InvalidArgumentError(f"--backend-config: {key} must be >= 0 (got {getattr(self, key)})")
        if not 0.0 <= self.sampling_share < 1.0:
            raise InvalidArgumentError(f"--backend-config: sampling_share must be in [0, 1) (the share of device time "
                                       f"decoding keeps while training waits; got {self.sampling_share})")
        if self.num_threads < 0:
            raise InvalidArgumentError(f"--backend-config: num_threads must be >= 0 (0: chosen from the cores "
                                       f"the engine owns; got {self.num_threads})")
        if self.snapshot_memory_mb < 0:
            raise InvalidArgumentError(f"--backend-config: snapshot_memory_mb must be >= 0 (0: what the device has "
                                       f"left after the memory plan; got {self.snapshot_memory_mb})")
        if self.max_full_models < 0:
            raise InvalidArgumentError(f"--backend-config: max_full_models must be >= 0 (got {self.max_full_models})")
        for key in ("max_lora_adapters", "max_lora_rank", "logprobs_chunk_tokens", "train_micro_batch_tokens",
                    "max_sampling_sequences", "max_resident_snapshots", "max_logprobs_k",
                    "fully_sharded_data_parallel_size", "num_processes", "zero_bucket_mb", "tensor_parallel_size"):
            if getattr(self, key) < 1:
                raise InvalidArgumentError(f"--backend-config: {key} must be >= 1 (got {getattr(self, key)})")
        if self.expert_parallel_size not in (1, self.tensor_parallel_size) and not self.experts_over_data_parallel:
            raise InvalidArgumentError(
                f"--backend-config: expert_parallel_size must be 1, tensor_parallel_size ({self.tensor_parallel_size}"
                f"; the experts spread over the tensor-parallel ranks) or, with tensor_parallel_size 1, "
                f"fully_sharded_data_parallel_size ({self.fully_sharded_data_parallel_size}; the experts spread over "
                f"the data-parallel ranks, tokens sent to them all-to-all) (got {self.expert_parallel_size})")
        if self.grouped_expert_gemm not in ("auto", "always", "never"):
            raise InvalidArgumentError(f"--backend-config: grouped_expert_gemm must be \"auto\", \"always\" or "
                                       f"\"never\" (got {self.grouped_expert_gemm!r})")
        if self.train_micro_batch_size < 0:
            raise InvalidArgumentError(f"--backend-config: train_micro_batch_size must be >= 0 (sequences per "
                                       f"micro-batch; 0: no limit; got {self.train_micro_batch_size})")
        if self.num_inference_engines < 1:
            raise InvalidArgumentError(f"--backend-config: num_inference_engines must be >= 1 (got "
                                       f"{self.num_inference_engines})")
        if not self.inference_engine_timeout_s > 0:
            raise InvalidArgumentError(f"--backend-config: inference_engine_timeout_s must be > 0 (got "
                                       f"{self.inference_engine_timeout_s})")
        if self.inference_engine_tensor_parallel_size < 1:
            raise InvalidArgumentError("--backend-config: inference_engine_tensor_parallel_size (generator."
                                       "inference_engine.tensor_parallel_size) must be >= 1 (got "
                                       f"{self.inference_engine_tensor_parallel_size})")
        self._validate_engine_devices()
        if self.max_sampling_length < 2:
            raise InvalidArgumentError(f"--backend-config: max_sampling_length must be >= 2 (got {self.max_sampling_length})")
        if self.dtype not in ("float32", "bfloat16"):
            raise InvalidArgumentError(f"--backend-config: dtype must be 'float32' or 'bfloat16' (got {self.dtype!r})")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise InvalidArgumentError(f"--backend-config: device must be 'cpu', 'cuda' or 'cuda:N' (got {self.device!r})")


@dataclass(frozen=True)
class ServerSettings:
    """Everything the API server needs, built once by the CLI (or a test) and passed down."""

    base_model: str  # what clients name in create_model / create_sampling_session
    model_aliases: tuple[str, ...] = ()  # further names clients may use for the same base model
    host: str = "127.0.0.1"
    port: int = 8000
    database_url: str | None = dataclasses.field(default=None, repr=False)  # default: SQLite in the data directory
    backend: BackendSettings = BackendSettings()
    max_request_bytes: int = 256 * 1024 * 1024  # larger bodies get 413
    long_poll_s: float = 25.0  # retrieve_future waits this long before answering try_again
    session_timeout_s: float = 300.0  # a session without heartbeats this long has its models unloaded
    checkpoints_base: str | None = None  # local directory or fsspec URL (s3://bucket/prefix); default: data dir
    checkpoints_storage_options: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)  # fsspec
    # process: a child process the server restarts if it dies; thread: inside the server process;
    # external: started separately (`skyrl-tx engine`), found through the database only
    engine: str = "process"
    # The base URL clients reach this server at (behind a proxy: the proxy's), e.g. https://tinker.example:443.
    # Signed checkpoint download URLs point there. None: the listen address.
    public_url: str | None = None
    # Signs checkpoint download URLs (api/url_signing.py). None: a random secret kept in the data directory (0600).
    url_signing_secret: str | None = dataclasses.field(default=None, repr=False)
    # keys: every route but healthz and the docs needs an API key (`skyrl-tx keys create`), and each key sees only
    # what it made (api/auth.py); none: no key is checked and everything has one owner (loopback only).
    auth: str = "none"
    # A vLLM server's base URL (its OpenAI-compatible API): sampling goes there (engine/external_sampler.py).
    external_inference_url: str | None = None
    # Ask SDK 0.38 clients to wait for samples through one retrieve_futures long poll per sampling client
    # (client config sample_use_retrieve_futures). Off by default: with it, about one SDK ServiceClient close in 30
    # hangs forever in the SDK (its futures poller's cancellation is swallowed by anyio's connect_tcp while the last
    # ack poll opens a connection, and the poller then waits for work that never comes), so clients use the
    # per-request retrieve_future poll, which the server serves either way.
    sample_retrieve_futures: bool = False

    def serves(self, name: str) -> bool:
        return name == self.base_model or name in self.model_aliases

    def served_names(self) -> list[str]:
        return [self.base_model, *self.model_aliases]

    def also_serving(self, name: str) -> ServerSettings:
        """These settings with `name` as one more alias (unchanged where it is served already)."""
        return self if self.serves(name) else dataclasses.replace(self, model_aliases=(*self.model_aliases, name))

    def public_base_url(self) -> str:
        """Where clients reach this server: public_url, else the listen address (a wildcard address becomes
        127.0.0.1: reachable from this machine only; set public_url for others)."""
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def validate(self) -> None:
        if self.auth not in AUTH_MODES:
            raise InvalidArgumentError(f"--auth: must be one of {', '.join(AUTH_MODES)} (got {self.auth!r})")
        if self.auth == "none" and not is_loopback(self.host):
            raise InvalidArgumentError(
                f"--host {self.host} is reachable from other machines, so this server needs API keys: create one "
                "with `skyrl-tx keys create --name NAME` (on the same database as the server: same --database-url "
                "or $SKYRL_TX_DATA_DIR), give it to the client as TINKER_API_KEY, and start the server with "
                "--auth keys")
        if self.public_url is not None:
            parsed = urllib.parse.urlsplit(self.public_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc or parsed.query or parsed.fragment:
                raise InvalidArgumentError(f"--public-url: must be an http(s) base URL such as "
                                           f"https://tinker.example.com (got {self.public_url!r})")


AUTH_MODES = ("keys", "none")


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (127.0.0.0/8, ::1, localhost); a wildcard address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
