"""Weight sync over c10d (Gloo, separate processes): the trainer's tensors reach every receiver bit for bit
(digest per version), bucketed across dtypes, sizes and layouts; and a LoRA tenant and a full fine-tune synced after
each of 3 training steps sample on the receivers exactly as on the trainer, every version kept (a sampling client on
version k keeps version-k results while later versions arrive)."""

from __future__ import annotations

import traceback
from typing import Any

from live_server import free_port
from rank_reports import collect_rank_reports, rank_context, rank_process

TIMEOUT_S = 240.0
WORLD = 3  # the trainer (rank 0, the root) and two receivers
VERSIONS = 3
PROMPT = [5, 17, 3, 250, 41, 9]


def _raw_tensors(version: int) -> dict[str, Any]:
    """Every case the bucketing has: dtypes that cannot share a bucket, a tensor larger than a bucket (sent in
    place), an empty and a 0-d tensor, a non-contiguous view; values that differ per version."""
    import torch

    g = torch.Generator().manual_seed(version)
    big = torch.randn(1000, generator=g)  # 4000 bytes > the 1000-byte buckets
    return {"a.fp32": torch.randn(10, 7, generator=g), "b.bf16": torch.randn(300, generator=g).to(torch.bfloat16),
            "c.int64": torch.randint(-5, 5, (3,), generator=g), "d.big": big, "e.empty": torch.empty(0, 4),
            "f.scalar": torch.tensor(float(version)), "g.transposed": torch.randn(6, 5, generator=g).t(),
            f"h.only_in_v{version}": torch.randn(2, 2, generator=g)}


def _raw_main(rank: int, port: int, out: Any) -> None:
    try:
        from skyrl_tx.parallel.group import RankAddress, join_group
        from skyrl_tx.parallel.weight_sync import make_weight_sync, weights_digest

        group = join_group(RankAddress(f"127.0.0.1:{port}", rank, WORLD), device="cpu", timeout_s=120)
        sync = make_weight_sync(group, root=0, bucket_bytes=1000)
        got = []
        for version in (1, 2):
            sent = _raw_tensors(version) if rank == 0 else {}
            tensors = sync.sync(version, sent, "cpu")
            last = sync.last
            got.append({"digest": weights_digest(tensors), "names": sorted(tensors),
                        "dtypes": {k: str(v.dtype) for k, v in tensors.items()},
                        "stats": (last.version, last.tensors, last.bytes, last.buckets)})
        out.put((rank, got))
    except Exception:  # noqa: BLE001
        out.put((rank, traceback.format_exc()))


def _model_main(model_dir: str, rank: int, port: int, out: Any) -> None:
    """Rank 0 trains a LoRA tenant and a full fine-tune and syncs both after every step; receivers load each
    version as snapshots. Then every rank samples every version greedily."""
    try:
        import torch
        from train_reference import ROBUST_ADAM, create_lora_with_nonzero_b, make_datums, our_logprobs, random_sequences

        from skyrl_tx.backend.native import NativeBackend
        from skyrl_tx.config import BackendSettings
        from skyrl_tx.parallel.group import RankAddress, join_group
        from skyrl_tx.parallel.weight_sync import make_weight_sync, weights_digest
        from skyrl_tx.types import SampleRequest, SamplingParams, TrainRequest

        torch.manual_seed(0)
        backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=2, max_lora_rank=4, max_full_models=1,
                                                           max_resident_snapshots=2 * VERSIONS))
        trainer = rank == 0
        if trainer:
            create_lora_with_nonzero_b(backend, "a", rank=4, alpha=8.0, seed=1, b_seed=2)
            backend.create_model("full", lora_rank=0)
        group = join_group(RankAddress(f"127.0.0.1:{port}", rank, WORLD), device="cpu", timeout_s=120)
        sync = make_weight_sync(group, root=0, bucket_bytes=256 << 10)  # several buckets for the full weights
        vocab = backend.decoder_config.vocab_size
        digests = []
        for version in range(1, VERSIONS + 1):
            sent = {}
            if trainer:
                requests = []
                for i, model_id in enumerate(("a", "full")):
                    seqs = random_sequences(vocab, [7, 4, 9], 10 * version + i)
                    datums = make_datums("cross_entropy", seqs, our_logprobs(backend, model_id, seqs), version)
                    requests.append(TrainRequest(model_id, datums, "cross_entropy"))
                backend.forward_backward(requests)
                for model_id in ("a", "full"):
                    backend.optim_step(model_id, ROBUST_ADAM)
                    backend.snapshot(model_id, f"{model_id}@{version}")
                sent = {**{f"a/{k}": v for k, v in backend.adapter_state_dict("a").items()},
                        **{f"full/{k}": v for k, v in backend.trainable_state("full").items()}}
            got = sync.sync(version, sent, "cpu")
            digests.append(weights_digest(got))
            if not trainer:  # each version becomes its own frozen snapshot
                backend.load_snapshot(f"a@{version}", {k[2:]: v for k, v in got.items() if k.startswith("a/")},
                                      rank=4, alpha=8.0)
                backend.load_frozen_model(f"full@{version}",
                                          {k[5:]: v.clone() for k, v in got.items() if k.startswith("full/")})
        params = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
        ids = [f"{m}@{v}" for m in ("a", "full") for v in range(1, VERSIONS + 1)]
        results = backend.sample([SampleRequest(PROMPT, params, weights_id=i) for i in ids])
        samples = {i: (list(r.sequences[0].tokens), [float(x) for x in r.sequences[0].logprobs])
                   for i, r in zip(ids, results)}
        out.put((rank, {"digests": digests, "samples": samples}))
    except Exception:  # noqa: BLE001
        out.put((rank, traceback.format_exc()))


def _run(target: Any, *args: Any) -> dict[int, Any]:
    context = rank_context()
    out, port = context.Queue(), free_port()
    procs = [rank_process(context, target, (*args, r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return collect_rank_reports(procs, out, WORLD, TIMEOUT_S, "weight sync")


def test_receivers_get_the_roots_tensors_bit_for_bit() -> None:
    import torch

    from skyrl_tx.parallel.weight_sync import weights_digest

    results = _run(_raw_main)
    for rank, got in results.items():
        assert isinstance(got, list), f"rank {rank}:\n{got}"
        for version, one in zip((1, 2), got):
            sent = _raw_tensors(version)
            assert one["digest"] == weights_digest(sent), (rank, version)
            assert one["names"] == sorted(sent) and one["dtypes"] == {k: str(v.dtype) for k, v in sent.items()}
            payload = sum(t.numel() * t.element_size() for t in sent.values())
            v, count, sent_bytes, buckets = one["stats"]
            # fp32 [10, 7] | bf16 | int64 | big fp32 alone | fp32 0-d + transposed [5, 6] + [2, 2]: 5 buckets
            assert (v, count, sent_bytes, buckets) == (version, len(sent), payload, 5), one["stats"]
    assert torch.bfloat16  # the bf16 case above is real


def test_synced_versions_sample_as_on_the_trainer(tiny_model_dir) -> None:
    results = _run(_model_main, str(tiny_model_dir("tiny-qwen3")))
    trainer = results[0]
    assert isinstance(trainer, dict), trainer
    for rank in range(1, WORLD):
        got = results[rank]
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        assert got["digests"] == trainer["digests"], rank  # bit-identical weights, every version
        for snapshot_id, (tokens, logprobs) in trainer["samples"].items():
            got_tokens, got_logprobs = got["samples"][snapshot_id]
            assert got_tokens == tokens, (rank, snapshot_id)
            assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs)) <= 1e-6, (rank, snapshot_id)
    # Versions differ (each step changed the weights), so each snapshot served its own version.
    assert len(set(trainer["digests"])) == VERSIONS
