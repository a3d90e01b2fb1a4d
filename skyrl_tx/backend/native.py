"""NativeBackend: the Python face of the C++ core (skyrl_tx._C.Backend); converts types and owns model I/O."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from skyrl_tx._ext import load_extension
from skyrl_tx.backend.native_convert import (
    CustomLossCache,
    core_names,
    native_request,
    native_sample_request,
    peft_names,
    sample_result,
    token_tensor,
    train_results,
)
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.models.checkpoint import load_weights, resolve_model_path, stored_text_prefix
from skyrl_tx.models.hf_config import DecoderConfig, load_decoder_config
from skyrl_tx.models.token_bytes import eos_token_ids, token_bytes_table
from skyrl_tx.types import (
    CustomLossGraph,
    DimuonParams,
    OptimParams,
    SampleRequest,
    SampleResult,
    TrainRequest,
    TrainResult,
)


def _native_model_config(cfg: DecoderConfig):
    _C = load_extension()
    native = _C.ModelConfig()
    for f in dataclasses.fields(cfg):
        if f.name in ("rope_scaling", "eos_token_ids"):
            continue
        setattr(native, f.name, getattr(cfg, f.name))
    scaling = _C.RopeScaling()
    for f in dataclasses.fields(cfg.rope_scaling):
        setattr(scaling, f.name, getattr(cfg.rope_scaling, f.name))
    native.rope_scaling = scaling
    return native


# Applied by the engine process, not the C++ core: threads (engine/threads.py), scheduling (engine/loop.py).
HOST_ONLY_SETTINGS = ("num_threads", "sampling_share", "snapshot_memory_mb", "recovery_snapshot_every_steps",
                      "recovery_snapshot_every_s", "futures_retention_hours", "fully_sharded_data_parallel_size",
                      "tensor_parallel_size", "num_processes", "coordinator_address", "colocate_all",
                      "num_inference_engines", "inference_engine_tensor_parallel_size", "inference_engine_timeout_s",
                      "weight_sync_digests", "kv_cache_tokens", "inference_engine_devices")


def _native_backend_config(settings: BackendSettings):
    native = load_extension().BackendConfig()
    for f in dataclasses.fields(settings):
        if f.name in HOST_ONLY_SETTINGS:
            continue
        setattr(native, f.name, getattr(settings, f.name))
    return native


class NativeBackend:
    """One base model with many LoRA adapters. Only the engine thread may call it (single owner)."""

    def __init__(self, model_dir: Path, settings: BackendSettings | None = None, tensor_parallel: Any = None,
                 expert_parallel: Any = None):
        """tensor_parallel: this rank's tensor-parallel group (_C.Collectives; skyrl_tx/parallel/group.py), whose
        ranks each keep their shard of the weights read here and make every call together. expert_parallel: the
        data-parallel group the MoE experts are spread over (settings.experts_over_data_parallel), or None."""
        self.model_dir = Path(model_dir)
        self.settings = settings or BackendSettings()
        self.tensor_parallel_rank = tensor_parallel.rank if tensor_parallel is not None else 0
        self._weight_sync: Any = None  # a sampler engine's rank: its place in the trainer's sync group
        self._sync_device = "cpu"  # where that group's tensors live: this rank's CUDA device on an NCCL group
        self.decoder_config = load_decoder_config(self.model_dir)
        # Adapters are named as the checkpoint names its text model (model.language_model.* for a vision-language one)
        self.text_prefix = stored_text_prefix(self.model_dir)
        self._core = load_extension().Backend(
            _native_model_config(self.decoder_config),
            _native_backend_config(self.settings),
            load_weights(self.model_dir, dtype=getattr(torch, self.settings.dtype)),  # FP8 dequantised to it
            tensor_parallel,
            expert_parallel,
        )
        if self.settings.gpu_memory_utilization > 0:  # the core sized the KV cache from the device's memory
            self.settings = dataclasses.replace(self.settings,
                                                max_sampling_sequences=self._core.max_sampling_sequences())
            logging.getLogger("skyrl_tx.backend").info(
                "KV cache: %d rows of %d tokens fit in gpu_memory_utilization=%g of %s",
                self.settings.max_sampling_sequences, self.settings.max_sampling_length,
                self.settings.gpu_memory_utilization, self.settings.device)
        token_bytes = token_bytes_table(self.model_dir, self.decoder_config.vocab_size)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.decoder_config.eos_token_ids)
        self._core.set_tokenizer_info(self.eos_token_ids, token_bytes or [])
        self._custom_losses = CustomLossCache()

    def close(self) -> None:
        """Nothing to stop: this backend runs in its caller's process (the backends that start processes, data-parallel
        ranks and sampler engines, stop them here; every backend make_backend returns has close)."""

    @classmethod
    def from_name(cls, base_model: str, settings: BackendSettings | None = None) -> NativeBackend:
        """base_model: a preset (tiny-qwen3), a local HF directory or a hub id."""
        return cls(resolve_model_path(base_model), settings)

    # ---- adapters -------------------------------------------------------------------------------
    def create_adapter(self, adapter_id: str, *, rank: int, alpha: float | None = None, seed: int = 0,
                       train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> int:
        cfg = load_extension().LoraConfig()
        cfg.rank, cfg.alpha, cfg.seed = rank, float(alpha if alpha is not None else rank), seed
        cfg.train_attn, cfg.train_mlp, cfg.train_unembed = train_attn, train_mlp, train_unembed
        return self._core.create_adapter(adapter_id, cfg)

    def remove_adapter(self, adapter_id: str) -> None:
        self._core.remove_adapter(adapter_id)

    def set_adapter_weights(self, adapter_id: str, state_dict: dict[str, torch.Tensor]) -> None:
        """Accepts PEFT state-dict names (with or without the 'base_model.model.' prefix)."""
        self._core.set_adapter_weights(adapter_id, core_names(state_dict))

    def adapter_state_dict(self, adapter_id: str) -> dict[str, torch.Tensor]:
        """PEFT-named factors (what adapter_model.safetensors holds), under the base checkpoint's names."""
        return peft_names(dict(self._core.get_adapter_weights(adapter_id)), self.text_prefix)

    def load_peft_adapter(self, adapter_id: str, adapter_dir: Path, seed: int = 0) -> int:
        """Creates `adapter_id` from a PEFT directory (adapter_config.json + adapter_model.safetensors)."""
        adapter_dir = Path(adapter_dir)
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        targets = set(cfg.get("target_modules") or [])
        groups = {"attn": {"q_proj", "k_proj", "v_proj", "o_proj"}, "mlp": {"gate_proj", "up_proj", "down_proj"},
                  "unembed": {"lm_head"}}
        # An MoE export names its MLPs as target_parameters (mlp.experts.gate_up_proj, mlp.gate_proj.weight, ...:
        # checkpoints.formats._fused_expert_targets); its factors keep the per-expert module names.
        mlp_parameters = [p for p in cfg.get("target_parameters") or []
                          if set(p.split(".")) & (groups["mlp"] | {"gate_up_proj"})]
        for name, modules in groups.items():
            if targets & modules and not modules <= targets:
                raise InvalidArgumentError(f"load adapter: target_modules {sorted(targets)} covers part of the {name} "
                                           f"group; skyrl_tx adapts all of {sorted(modules)} or none")
        slot = self.create_adapter(adapter_id, rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), seed=seed,
                                   train_attn=bool(targets & groups["attn"]),
                                   train_mlp=bool(targets & groups["mlp"] or mlp_parameters),
                                   train_unembed=bool(targets & groups["unembed"]))
        from skyrl_tx.checkpoints.peft_experts import unfuse_experts

        self.set_adapter_weights(adapter_id, unfuse_experts(load_file(str(adapter_dir / "adapter_model.safetensors")),
                                                            int(cfg["r"])))
        return slot

    def create_model(self, model_id: str, *, lora_rank: int, alpha: float | None = None, seed: int = 0,
                     train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
                     optimizer: str = "adamw") -> None:
        """lora_rank >= 1: a LoRA adapter in a slot of the shared base; lora_rank == 0: full fine-tuning.
        optimizer: "adamw" or "dimuon" (LoRA only), fixed for the model's life."""
        if optimizer != "adamw" and lora_rank == 0:
            raise InvalidArgumentError(f"create_model: the {optimizer} optimizer orthogonalises LoRA factor updates; "
                                       "full fine-tuning (lora rank 0) uses adamw")
        if lora_rank == 0:
            self._core.create_full_model(model_id)
            return
        self.create_adapter(model_id, rank=lora_rank, alpha=alpha, seed=seed, train_attn=train_attn,
                            train_mlp=train_mlp, train_unembed=train_unembed)
        if optimizer != "adamw":
            try:
                self._core.set_optimizer_kind(model_id, optimizer)
            except Exception:
                self._core.remove_model(model_id)
                raise

    def optimizer_kind(self, model_id: str) -> str:
        return self._core.optimizer_kind(model_id)

    def remove_model(self, model_id: str) -> None:
        self._core.remove_model(model_id)

    # ---- training -------------------------------------------------------------------------------
    def forward_backward(self, requests: Sequence[TrainRequest]) -> list[TrainResult]:
        """One pass over all requests; gradients accumulate per model until optim_step."""
        return train_results(self._core.forward_backward([native_request(r, self._custom_losses) for r in requests]))

    def forward(self, requests: Sequence[TrainRequest]) -> list[TrainResult]:
        """forward_backward's outputs without gradients or side effects."""
        return train_results(self._core.forward([native_request(r, self._custom_losses) for r in requests]))

    def check_custom_loss(self, graph: CustomLossGraph) -> None:
        """Rebuilds a create_custom_loss graph from the core's allow-list (InvalidArgumentError names the node it
        refuses), and keeps it for the forward_backward calls that use it."""
        self._custom_losses.get(graph)

    def attach_collectives(self, group: Any) -> None:
        """Data parallelism (skyrl_tx.parallel.group.join_group's Collectives; None: one process again): every rank
        then makes the same calls with the same requests, computes its share of the rows and ends with the same
        results and summed gradients as one process."""
        self._core.attach_collectives(group)

    def optim_step(self, model_id: str, params: OptimParams) -> dict[str, float]:
        """AdamParams for an AdamW model, DimuonParams for a Dimuon one (else InvalidArgumentError)."""
        ext = load_extension()
        native = ext.DimuonParams() if isinstance(params, DimuonParams) else ext.AdamParams()
        for f in dataclasses.fields(params):
            setattr(native, f.name, float(getattr(params, f.name)))
        return dict(self._core.optim_step(model_id, native))

    def trainable_state(self, model_id: str, names: set[str] | None = None,
                        model_dtype: bool = False) -> dict[str, torch.Tensor]:
        """PEFT names for LoRA adapters, HF names for full fine-tuning; float32 CPU copies. `names` (a full model's
        HF names): only those; model_dtype: in the dtype the model holds them (a snapshot spill's bytes)."""
        return peft_names(self._core.trainable_state(model_id, set(names or ()), model_dtype), self.text_prefix)

    def state_views(self, model_id: str) -> tuple[dict[str, torch.Tensor], Any]:
        """The live trainable tensors (trainable_state's names) and optimizer state (an OptimizerState of views), not
        copies: copied off the engine thread while the model does not step (engine/recovery_state.py). The core
        refuses (UnimplementedError) a model split over ranks."""
        weights, optimizer = self._core.state_views(model_id)
        return peft_names(weights, self.text_prefix), optimizer

    def weight_stamps(self, model_id: str) -> dict[str, tuple[int, int]]:
        """A full model's tensors' stamps: an equal stamp means equal contents (engine/snapshot_memory.py)."""
        return dict(self._core.weight_stamps(model_id))

    def frozen_bytes(self) -> int:
        """Bytes the frozen full models (full fine-tuning snapshots) hold, shared tensors counted once."""
        return int(self._core.frozen_bytes())

    def snapshot_cost(self, model_id: str) -> int:
        """Bytes a snapshot of full model `model_id` would add now (its tensors no frozen copy shares)."""
        return int(self._core.snapshot_cost(model_id))

    def trainable_grads(self, model_id: str) -> dict[str, torch.Tensor]:
        return peft_names(self._core.trainable_grads(model_id), self.text_prefix)

    def optimizer_state_bytes(self, model_id: str) -> int:
        """Optimizer state and pending gradients this rank holds for the model (a ZeRO-sharded full fine-tune:
        about 1/world_size of one process's)."""
        return int(self._core.optimizer_state_bytes(model_id))

    # ---- checkpoint state -----------------------------------------------------------------------
    def set_trainable_state(self, model_id: str, weights: dict[str, torch.Tensor]) -> None:
        """Inverse of trainable_state (PEFT or HF names); every name and shape is checked first."""
        self._core.set_trainable_state(model_id, core_names(weights))

    def optimizer_state(self, model_id: str):
        """The model's optimizer state (extension OptimizerState: kind, step, and by core name AdamW's exp_avg,
        exp_avg_sq or Dimuon's momentum)."""
        return self._core.optimizer_state(model_id)

    def set_optimizer_state(self, model_id: str, step: int, exp_avg: dict[str, torch.Tensor],
                            exp_avg_sq: dict[str, torch.Tensor], *, kind: str = "adamw",
                            momentum: dict[str, torch.Tensor] | None = None,
                            master: dict[str, torch.Tensor] | None = None) -> None:
        """Its kind must be the model's optimizer (InvalidArgumentError naming both otherwise). master: AdamW's
        float32 master weights of bfloat16 weights, each rounding to the model's current weight (load the weights
        first); None or empty: rebuilt from the current weights at the next step."""
        state = load_extension().OptimizerState()
        state.kind, state.step = kind, int(step)
        state.exp_avg, state.exp_avg_sq = core_names(exp_avg), core_names(exp_avg_sq)
        state.momentum = core_names(momentum or {})
        state.master = core_names(master or {})
        self._core.set_optimizer_state(model_id, state)

    def restore_optimizer(self, model_id: str, saved: dict[str, Any]) -> None:
        """Restores what checkpoints.formats.read_optimizer returned."""
        self.set_optimizer_state(model_id, saved["step"], saved["exp_avg"], saved["exp_avg_sq"], kind=saved["kind"],
                                 momentum=saved["momentum"], master=saved.get("master"))

    def load_snapshot(self, snapshot_id: str, weights: dict[str, torch.Tensor], *, rank: int, alpha: float,
                      train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> None:
        """A sampleable frozen adapter from saved factors (no live slot needed)."""
        cfg = load_extension().LoraConfig()
        cfg.rank, cfg.alpha, cfg.seed = rank, float(alpha), 0
        cfg.train_attn, cfg.train_mlp, cfg.train_unembed = train_attn, train_mlp, train_unembed
        self._core.load_snapshot(snapshot_id, cfg, core_names(weights))

    def load_frozen_model(self, snapshot_id: str, weights: dict[str, torch.Tensor]) -> None:
        """A sampleable frozen full model from HF-named weights."""
        self._core.load_frozen_model(snapshot_id, dict(weights))

    def frozen_model_weights(self, snapshot_id: str) -> dict[str, torch.Tensor]:
        """A frozen full model's HF-named weights (CPU copies in the model's dtype); NotFoundError if not loaded."""
        return dict(self._core.frozen_model_weights(snapshot_id))

    def has_snapshot(self, snapshot_id: str) -> bool:
        return self._core.has_snapshot(snapshot_id)

    # ---- weight sync: a sampler engine's ranks, each in the trainer's sync group (parallel/weight_sync.py) ------
    def join_weight_sync(self, address: str, first_rank: int, world: int, timeout_s: float,
                         on_cuda: bool = False) -> None:
        """Joins the trainer's sync group at `address` as rank first_rank + this rank's tensor-parallel rank (every
        rank of a tensor-parallel sampler engine receives the broadcast itself), leaving the old group first. on_cuda
        (layout.weight_sync_on_cuda): the group is NCCL and the weights arrive on this rank's device; else Gloo."""
        from skyrl_tx.parallel.weight_sync import join_sync_group

        self._weight_sync = None
        self._sync_device = self.settings.device if on_cuda else "cpu"
        self._weight_sync = join_sync_group(address, first_rank + self.tensor_parallel_rank, world, timeout_s,
                                            device=self._sync_device)

    def receive_weights(self, snapshot_id: str, lora: dict[str, Any] | None, resync: bool,
                        digest: bool) -> tuple[Exception | None, str | None]:
        """Receives the trainer's next broadcast (whole tensors; this rank keeps its part) as frozen version
        `snapshot_id`: adapter factors when `lora` gives their shape, else full weights. A resync of a version held
        already is received and dropped. Returns (the load's error, the weights' digest when asked); a failed
        broadcast raises (the group is broken)."""
        from skyrl_tx.parallel.weight_sync import weights_digest

        tensors = self._weight_sync.sync(0, {}, self._sync_device)  # Gloo: CPU copies that loading moves to the device
        try:
            if resync and self.has_snapshot(snapshot_id):
                pass
            elif lora is not None:
                self.load_snapshot(snapshot_id, tensors, **lora)
            else:
                self.load_frozen_model(snapshot_id, {k: v.clone() for k, v in tensors.items()})
        except Exception as exc:  # noqa: BLE001 - the load's error, reported to the trainer, which undoes the sync
            return exc, None
        return None, weights_digest(tensors) if digest else None

    # ---- sampling -------------------------------------------------------------------------------
    def snapshot(self, model_id: str, snapshot_id: str) -> None:
        """Freezes the adapter's current weights; sampling `snapshot_id` ignores later training."""
        self._core.snapshot_adapter(model_id, snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> None:
        self._core.remove_snapshot(snapshot_id)

    def submit_sample(self, request: SampleRequest) -> int:
        """Queues a request for the continuous batch; sample_step() returns it when finished."""
        return self._core.submit_sample(native_sample_request(request))

    def sample_step(self) -> list[tuple[int, SampleResult]]:
        return [(i, sample_result(r)) for i, r in self._core.sample_step()]

    def sample_progress(self, sample_ids: Sequence[int]) -> dict[int, list[list[int]]]:
        """Streaming: for each of `sample_ids` still decoding, the tokens each of its samples has so far."""
        return {i: [list(t) for t in tokens] for i, tokens in self._core.sample_progress(list(sample_ids)).items()}

    def sample(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Runs the requests to completion in one continuous batch."""
        return [sample_result(r) for r in self._core.sample([native_sample_request(r) for r in requests])]


    # ---- compute --------------------------------------------------------------------------------
    def token_logprobs(self, input_tokens: Sequence[Sequence[int] | torch.Tensor],
                       target_tokens: Sequence[Sequence[int] | torch.Tensor],
                       adapter_ids: Sequence[str] | None = None) -> list[torch.Tensor]:
        """log p(target_t | input_0..t) per sequence; adapter id "" (default) is the base model."""
        ids = list(adapter_ids) if adapter_ids is not None else [""] * len(input_tokens)
        return self._core.token_logprobs([token_tensor(t) for t in input_tokens],
                                         [token_tensor(t) for t in target_tokens], ids)

