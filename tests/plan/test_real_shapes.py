"""Every published family at its real widths (vocab, head_dim, GQA ratio, expert width, MLA ranks; sharded safetensors
+ index in the hub's names, bf16), cut to 1-2 layers, through the real SDK against one live server per family: load,
LoRA step, sample, save, export (PEFT and merged, read back by transformers + PEFT), reload; the engine's peak memory
against `skyrl-tx plan`'s figure for the same layout."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from live_server import live_server
from sdk_training import download, token_datum
from tinker import types

from skyrl_tx.config import BackendSettings
from skyrl_tx.models.hf_config import decoder_config_from_dict, load_decoder_config
from skyrl_tx.models.published_checkpoint import reduced_model_dir
from skyrl_tx.plan.memory import plan_memory
from skyrl_tx.plan.published import PUBLISHED


@dataclass(frozen=True)
class Family:
    name: str
    num_layers: int = 1
    num_experts: int | None = None  # the routed experts kept (None: all of the published count)
    peft_tolerance: float = 0.05  # mean |dlogprob| of transformers + PEFT vs the server, both in bf16

    @property
    def id(self) -> str:
        return self.name.split("/")[1]


FAMILIES = [
    Family("Qwen/Qwen3-0.6B"),  # tied embeddings
    Family("meta-llama/Llama-3.1-8B"),  # vocab 128,256, llama3 RoPE scaling, GQA 32/8
    Family("Qwen/Qwen3-30B-A3B", num_experts=32),  # 32 of 128 experts of width 768 (top-8 kept)
    Family("Qwen/Qwen3.5-9B", num_layers=2),  # a Gated DeltaNet and a gated-attention layer, vocab 248,320
    # one MoE layer with MLA (q/kv ranks 1536/512); 16 of 256 experts (8 groups of 2, top-4 groups, top-8 kept)
    # (group-limited sigmoid routing: a token's expert can differ between two bf16 implementations; measured 0.059)
    Family("deepseek-ai/DeepSeek-V3", num_experts=16, peft_tolerance=0.1),
]
CONFIG = {"dtype": "bfloat16", "max_lora_adapters": 2, "max_lora_rank": 8, "max_resident_snapshots": 1,
          "max_full_models": 0, "max_sampling_sequences": 4, "max_sampling_length": 128,
          "train_micro_batch_tokens": 32, "logprobs_chunk_tokens": 32}  # a micro-batch: what one step here runs
TOKENS = [5, 17, 300, 42, 7, 99, 1000, 12, 64, 128, 256, 3, 9, 27, 81, 243, 11, 1500, 33, 8]
PLAN_TOLERANCE = 0.15  # issue 37 item 9: the plan within 15% of the measured peak
LEARNING_RATE = 5e-4  # two steps move the logprobs by 2.9-9.6 nats at these widths: far more than the exports differ
# the widths a reduced checkpoint keeps as published (what differs by design: depth, expert count, token ids)
CUT = {"num_hidden_layers", "layer_types", "first_k_dense_replace", "num_experts", "num_experts_per_tok", "n_group",
       "topk_group", "eos_token_ids"}


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.id)
def family(request: pytest.FixtureRequest, preset_cache: Path):
    """(family, checkpoint directory), written once: into $SKYRL_TX_TEST_PUBLISHED_CACHE when set (a directory
    outside the checkout that CI may keep between runs; the generator's version is in each name), else into this
    session's cache and removed after the family's tests (1.5-5.2 GB each; pytest keeps three sessions' temp dirs)."""
    spec: Family = request.param
    root = os.environ.get("SKYRL_TX_TEST_PUBLISHED_CACHE")
    with pytest.MonkeyPatch.context() as mp:
        if root:
            mp.setenv("SKYRL_TX_CACHE_DIR", root)
        model_dir = reduced_model_dir(spec.name, num_layers=spec.num_layers, num_experts=spec.num_experts)
    yield spec, model_dir
    if not root:
        shutil.rmtree(model_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def server(family):
    spec, model_dir = family
    with live_server(base_model=str(model_dir), aliases=[spec.name], backend_config=CONFIG) as url:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TINKER_BASE_URL", url)
            mp.setenv("TINKER_API_KEY", "tml-test")
            mp.setenv("TINKER_TELEMETRY", "0")
            yield url


def _engine_memory(url: str) -> dict[str, int]:
    """The engine process's /proc/PID/status memory lines in bytes: VmHWM (the peak the plan is held to) and, to tell
    a failure's cause, VmRSS now split into RssAnon (tensors, heap) and RssFile (libraries' code, mmapped weights)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=10) as response:
        pid = json.loads(response.read())["engine_pid"]
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    assert "VmHWM" in fields, "no VmHWM in /proc/PID/status"
    return fields


def _logprobs(client, tokens: list[int]) -> torch.Tensor:
    out = client.forward([token_datum(tokens)], "cross_entropy").result()
    return torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist())


def _hf_logprobs(model_dir: Path, tokens: list[int], adapter: Path | None = None) -> torch.Tensor:
    """transformers' logprobs of `tokens` (in bf16, as the server computes: float32 copies of these widths would not
    fit beside the server on the CI machine), the model freed before returning."""
    from hf_reference import hf_token_logprobs, load_hf_model
    from peft import PeftModel

    model = load_hf_model(model_dir, torch.bfloat16)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    try:
        return hf_token_logprobs(model, tokens)
    finally:
        del model
        gc.collect()


def _assert_merged_is_base_plus_adapter(model_dir: Path, adapter: Path, merged: Path) -> int:
    """Every adapted tensor of the merged export is bf16(W + alpha/r * B @ A) (to bf16's half-ulp: the merge rounds
    once), read a block of rows at a time; returns how many were checked. Compared in the stored dtype first and only
    the elements that differ in float32 (torch.testing.assert_close on every float32 block took 45-90 s of
    DeepSeek-V3's 1.7e9 adapted elements)."""
    from contextlib import ExitStack

    from safetensors import safe_open
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    factors = load_file(str(adapter / "adapter_model.safetensors"))
    with ExitStack() as stack:
        def shards(directory: Path) -> dict[str, object]:  # tensor name -> the open shard that holds it
            paths = sorted(directory.glob("*.safetensors"))
            handles = [stack.enter_context(safe_open(str(path), "pt")) for path in paths]
            return {name: handle for handle in handles for name in handle.keys()}

        base_shards, merged_shards = shards(model_dir), shards(merged)
        tied = load_decoder_config(model_dir).tie_word_embeddings  # the merge unties an adapted head
        names = [k for k in factors if k.endswith(".lora_A.weight")]
        for name in names:
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            base_name = "model.embed_tokens.weight" if module == "lm_head" and tied else f"{module}.weight"
            assert base_name in base_shards, f"{base_name} is in no shard of {model_dir}"
            assert f"{module}.weight" in merged_shards, f"{module}.weight is not in the merged export"
            base = base_shards[base_name].get_tensor(base_name)  # [out, in] bf16
            ours = merged_shards[f"{module}.weight"].get_tensor(f"{module}.weight")
            assert ours.shape == base.shape and ours.dtype == base.dtype, (module, ours.shape, ours.dtype)
            lora_a = factors[name].float()  # [r, in]
            lora_b = factors[name.replace("lora_A", "lora_B")].float()  # [out, r]
            for start in range(0, base.shape[0], 4096):  # float32 blocks of rows: an unembedding is 1e9 elements
                rows = slice(start, start + 4096)
                expected = base[rows].float().addmm_(lora_b[rows], lora_a, alpha=scaling)  # [<=4096, in] float32
                differ = ours[rows] != expected.to(ours.dtype)  # a different rounding of the same sum: rare
                if differ.any():
                    torch.testing.assert_close(ours[rows][differ].float(), expected[differ], atol=0, rtol=2 ** -8,
                                               msg=lambda m: f"{module}, rows {start}+: {m}")
    return len(names)


def test_checkpoint_has_the_published_widths_in_the_hub_layout(family) -> None:
    spec, model_dir = family
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as the hub's checkpoints are
    ours = dataclasses.asdict(load_decoder_config(model_dir))
    published = dataclasses.asdict(decoder_config_from_dict(PUBLISHED[spec.name]))
    assert {k: v for k, v in ours.items() if k not in CUT} == {k: v for k, v in published.items() if k not in CUT}
    assert ours["num_hidden_layers"] == spec.num_layers
    assert ours["num_experts"] == (spec.num_experts or published["num_experts"])


def test_lora_step_sample_save_export_reload_and_peak_within_plan(family, server, tmp_path: Path) -> None:
    from skyrl_tx.checkpoints.merge import merge_adapter

    spec, model_dir = family
    service = tinker.ServiceClient()
    client = service.create_lora_training_client(base_model=spec.name, rank=8, seed=1).result()
    before = _logprobs(client, TOKENS)
    assert before.shape == (len(TOKENS) - 1,)
    for _ in range(2):
        result = client.forward_backward([token_datum(TOKENS)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
        assert np.isfinite(np.asarray(result.loss_fn_outputs[0]["logprobs"].tolist())).all()
    after = _logprobs(client, TOKENS)
    assert after.sum() > before.sum()  # the step trained the adapter on these tokens
    assert (after - before).abs().mean() > 3 * spec.peft_tolerance  # by more than the exports may differ below

    sampler = client.save_weights_and_get_sampling_client().result()
    sample = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:8]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0)).result()
    assert [len(s.tokens) for s in sample.sequences] == [6, 6]

    path = client.save_state("real-shape").result().path
    reloaded = service.create_training_client_from_state(path).result()
    torch.testing.assert_close(_logprobs(reloaded, TOKENS), after, atol=0, rtol=0)

    rest = tinker.RestClient(base_url=server)
    adapter = download(rest.get_external_weights_urls(client.save_weights_external("peft").result().path)
                       .result().urls, tmp_path / "adapter")
    peft_error = (_hf_logprobs(model_dir, TOKENS, adapter) - after).abs().mean()
    merge_adapter(model_dir, adapter, tmp_path / "merged")
    assert _assert_merged_is_base_plus_adapter(model_dir, adapter, tmp_path / "merged") > 0
    # transformers reads the merged export back; its bf16 weights round W + delta once more (half an ulp of W is
    # about delta's size here), so its logprobs are held to moving from the base's towards the adapter's
    merged = _hf_logprobs(tmp_path / "merged", TOKENS)
    merged_error, merged_move = (merged - after).abs().mean(), (merged - before).abs().mean()
    shutil.rmtree(tmp_path / "merged")  # up to 5 GB; pytest keeps three sessions' temp dirs

    planned = plan_memory(load_decoder_config(model_dir), BackendSettings.from_dict(CONFIG)).devices[0].total
    memory = _engine_memory(server)
    measured = memory["VmHWM"]
    now = ", ".join(f"{key} {memory.get(key, 0) / 2**30:.3f}" for key in ("VmRSS", "RssAnon", "RssFile"))
    print(f"\nreal-shape {spec.name} ({spec.num_layers} layer(s), {spec.num_experts or 'all'} experts, bf16): engine "
          f"peak {measured / 2**30:.3f} GiB (now {now}), plan {planned / 2**30:.3f} GiB, plan/measured "
          f"{planned / measured:.3f}; "
          f"trained |dlogprob| {(after - before).abs().mean():.4f}; vs the server: PEFT {peft_error:.4f}, merged "
          f"{merged_error:.4f} (from the base {merged_move:.4f})")
    assert peft_error < spec.peft_tolerance
    assert merged_error < merged_move / 2
    # issue 37 item 9's bound, both ways. Not one-sided (plan >= peak): the process's own share (libtorch's resident
    # code, the allocator's arenas) differs by machine, 0.52 GiB here and up to 0.69 on CI (Qwen3-0.6B's peak read
    # 1.164, 1.250 and 1.330 GiB on three machines for the same steps), so no constant is above every machine's
    # and within 15% of this one's; the plan sits between them (plan/measured 0.99-1.13 on the machines seen).
    assert abs(planned - measured) <= PLAN_TOLERANCE * measured
