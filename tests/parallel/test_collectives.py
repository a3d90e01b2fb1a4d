"""c10d collectives from C++ (skyrl_tx._C.Collectives) across real processes on Gloo, and the token split."""

from __future__ import annotations

import os
import signal
import traceback
from typing import Any

import pytest
from live_server import free_port
from rank_reports import collect_rank_reports, rank_context, rank_process

TIMEOUT_S = 240.0  # spawned ranks import torch: slow on a loaded 2-core box


def _rank_main(rank: int, world: int, port: int, scenario: str, out: Any) -> None:
    try:
        import torch

        from skyrl_tx.parallel.group import RankAddress, join_group, leave_group

        timeout_s = {"ok": 180.0, "alone": 4.0, "dies": 120.0}[scenario]
        group = join_group(RankAddress(f"127.0.0.1:{port}", rank, world), device="cpu", timeout_s=timeout_s)
        if scenario == "dies":
            if rank == 1:  # killed before the collective: rank 0's all-reduce must fail, not hang
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(4)
            try:
                group.all_reduce_sum(t)
                out.put((rank, "no error"))
            except Exception as exc:  # noqa: BLE001
                out.put((rank, f"{type(exc).__name__}: {exc}"))
            return
        t = torch.full((3, 2), float(rank + 1))  # [3, 2]
        group.all_reduce_sum(t)
        parts = [torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1), torch.full((5,), float(rank))]
        group.all_reduce_sum_flat(parts)
        b = torch.full((4,), float(rank * 10))  # [4]
        group.broadcast(b, root=world - 1)
        big = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)  # [world * 2]
        scattered = group.reduce_scatter_sum(big)  # [2]
        gathered = group.all_gather(torch.full((3,), float(rank)))  # [world * 3]
        # Uneven counts, zeros included: row i of what rank r sends rank d is [r, d, i].
        send = [_rows_sent(rank, d) for d in range(world)]
        rows = [[float(rank), float(d), float(i)] for d in range(world) for i in range(send[d])]
        exchanged = group.all_to_all(torch.tensor(rows).view(-1, 3), send, [_rows_sent(s, rank) for s in range(world)])
        group.barrier()
        stats = {name: (s.calls, s.bytes) for name, s in group.stats().items()}
        seconds = sum(s.seconds for s in group.stats().values())
        group.reset_stats()
        out.put((rank, {"sum": t.tolist(), "flat": [p.tolist() for p in parts], "bcast": b.tolist(),
                        "scattered": scattered.tolist(), "gathered": gathered.tolist(),
                        "exchanged": exchanged.tolist(), "sent_bytes": 4 * len(rows) * 3, "stats": stats,
                        "seconds": seconds, "after_reset": group.stats(), "rank": group.rank,
                        "world": group.world_size}))
        leave_group()
    except Exception:  # noqa: BLE001
        out.put((rank, traceback.format_exc()))


def _rows_sent(source: int, dest: int) -> int:
    return (source + 1) * (dest + 2) % 3  # 0, 1 or 2 rows


def _run(world: int, scenario: str = "ok", ranks: list[int] | None = None) -> dict[int, Any]:
    context = rank_context()
    out, port = context.Queue(), free_port()
    procs = [rank_process(context, _rank_main, (r, world, port, scenario, out))
             for r in (range(world) if ranks is None else ranks)]
    for p in procs:
        p.start()
    expected = len(procs) - (scenario == "dies")  # a killed rank reports nothing
    return collect_rank_reports(procs, out, expected, TIMEOUT_S, f"world {world} ({scenario})")


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_equal_their_formulas(world: int) -> None:
    import torch

    results = _run(world)
    total = sum(range(1, world + 1))
    for rank in range(world):
        got = results[rank]
        assert isinstance(got, dict), got
        assert (got["rank"], got["world"]) == (rank, world)
        assert got["sum"] == torch.full((3, 2), float(total)).tolist()
        assert got["flat"][0] == (torch.arange(6, dtype=torch.float32).view(2, 3) * total).tolist()
        assert got["flat"][1] == [float(sum(range(world)))] * 5
        assert got["bcast"] == [float((world - 1) * 10)] * 4
        summed = torch.arange(2 * world, dtype=torch.float32) * total
        assert got["scattered"] == summed[2 * rank:2 * rank + 2].tolist()
        assert got["gathered"] == [float(r) for r in range(world) for _ in range(3)]
        assert got["exchanged"] == [[float(s), float(rank), float(i)] for s in range(world)
                                    for i in range(_rows_sent(s, rank))]
        # Counters: what this rank handed each operation (float32: 4 bytes an element).
        assert got["stats"] == {"all_reduce": (2, 4 * (6 + 6 + 5)), "broadcast": (1, 16),
                                "reduce_scatter": (1, 4 * 2 * world), "all_gather": (1, 4 * 3 * world),
                                "all_to_all": (1, got["sent_bytes"]), "barrier": (1, 0)}, got["stats"]
        assert got["seconds"] > 0 and got["after_reset"] == {}


def test_a_rank_that_never_joins_is_an_error_naming_the_group() -> None:
    results = _run(2, scenario="alone", ranks=[0])  # rank 1 never starts
    message = results[0]
    assert "could not join the group at 127.0.0.1:" in message and "rank 0 of 2" in message, message


def test_a_dead_rank_fails_the_collective_instead_of_hanging() -> None:
    results = _run(2, scenario="dies")
    assert results[0].startswith("InternalError: collective all_reduce failed on rank 0 of 2"), results[0]


def _lpt_reference(tokens: list[int], world: int) -> list[int]:
    """Longest first, each to the least-loaded rank (lowest on ties)."""
    load, ranks = [0] * world, [0] * len(tokens)
    for row in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        ranks[row], load[rank] = rank, load[rank] + tokens[row]
    return ranks


@pytest.mark.parametrize("tokens,world", [([100, 3, 50, 50, 7], 2), ([5], 4), ([], 3), ([9, 9, 9, 9, 9, 9, 9], 4),
                                          ([1000, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2), ([30, 20, 20, 10, 10, 10], 3)])
def test_split_rows_by_tokens_balances_tokens_not_rows(tokens: list[int], world: int) -> None:
    from skyrl_tx._ext import load_extension

    got = load_extension().split_rows_by_tokens(tokens, world)
    assert got == _lpt_reference(tokens, world)
    loads = [sum(t for t, r in zip(tokens, got) if r == k) for k in range(world)]
    if tokens:  # LPT bound: the largest load is at most the largest row plus an even share
        assert max(loads) <= max(tokens) + sum(tokens) / world


def test_split_rows_by_tokens_rejects_bad_input() -> None:
    from skyrl_tx._ext import load_extension
    from skyrl_tx.errors import InvalidArgumentError

    native = load_extension()
    with pytest.raises(InvalidArgumentError, match="world_size must be >= 1"):
        native.split_rows_by_tokens([1, 2], 0)
    with pytest.raises(InvalidArgumentError, match="negative token count"):
        native.split_rows_by_tokens([1, -2], 2)


def test_coordinator_ports_come_from_outside_the_ephemeral_range() -> None:
    """A port in the ephemeral range can be handed to any outbound connection (or to a rank's own retried connect,
    a loopback self-connect) before rank 0's store binds it: the flake this test guards against."""
    import socket

    from skyrl_tx.ports import _ephemeral_low, free_local_port

    low = _ephemeral_low()
    ports = {free_local_port() for _ in range(20)}
    assert all(15000 <= p < low for p in ports), ports
    assert len(ports) > 1  # random, so parallel test processes do not pick the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
