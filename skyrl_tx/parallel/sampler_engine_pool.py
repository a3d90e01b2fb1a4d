"""SamplerEnginePool: the sampler engine processes of a disaggregated server, their pipes, and the c10d sync group
the trainer shares with the live ones (parallel/sampler_engines.py routes samples and syncs weights through it).

Each engine slot is lost, starting, or live:
- a lost engine (dead, hung, or silent in a sync) is killed at once; `restart_lost` then starts its replacement in
  the background (a spawned process that loads the base model on its own: nothing waits for it);
- a starting engine says ("loaded",) once it holds the base model; `poll_starting` looks for that without waiting;
- a live engine is a member of the sync group, or was until another member was lost: the caller rebuilds the group
  (`regroup`) with the live engines alone before its next sync, and with a loaded replacement when it admits it.
  Only processes that hold the model are ever asked to join a group, so a regroup is a rendezvous, never a load.
  Members are checked alive before a sync or a regroup is sent to any of them (one sent a command the others cannot
  complete would sit in it until the group's timeout). A replacement that dies before it is admitted, or whose
  admission fails with no other engine to blame, counts a failed start: after MAX_FAILED_STARTS it is given up.
Answers to a regroup or a sync carry the tag of their command, so an answer to an abandoned one is never mistaken
for the next one's. Only the engine loop's thread calls it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InternalError
from skyrl_tx.parallel.layout import sampler_device
from skyrl_tx.parallel.sampler_engine_process import sampler_engine_main
from skyrl_tx.parallel.weight_sync import JOIN_TIMEOUT_S, join_sync_group

log = logging.getLogger("skyrl_tx.parallel")

START_TIMEOUT_S = JOIN_TIMEOUT_S  # a sampler engine loads the base model within this, or it is started again
MAX_FAILED_STARTS = 3  # replacements of one engine that died or timed out loading, in a row, before it is given up
GROUP_TIMEOUT_S = 60.0  # floor of the sync group's join and collective timeout (its members hold the model already)


class EngineLost(Exception):
    """A sampler engine stopped answering in the middle of a sync or a regroup (it is marked lost)."""


class SamplerEnginePool:
    """The engine slots 0 .. num_inference_engines - 1 (see the module docstring)."""

    def __init__(self, model_dir: Path, settings: BackendSettings, sync_on_cuda: bool, sync_device: str):
        self._model_dir, self._settings = model_dir, settings
        self._sync_on_cuda, self._sync_device = sync_on_cuda, sync_device
        count = settings.num_inference_engines
        self.timeout_s = settings.inference_engine_timeout_s
        self.group_timeout_s = max(GROUP_TIMEOUT_S, self.timeout_s)
        self.conns: list[Any] = [None] * count
        self.procs: list[Any] = [None] * count
        self.heard = [time.monotonic()] * count  # when each engine last sent anything
        self.lost: dict[int, str] = {}  # killed, not restarted yet → why
        self.starting: dict[int, float] = {}  # replacement spawned, loading the model → when it was spawned
        self.loaded: set[int] = set()  # starting engines that hold the model: ready to be admitted
        self.given_up: dict[int, str] = {}  # engines whose replacements kept failing to start
        self._failed_starts = [0] * count
        self.members: list[int] = []  # the sync group's engines, in rank order
        self.sync: Any = None  # the trainer's WeightSync on that group (None: no group)
        self._tags = itertools.count(1)

    # ---- states --------------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [i for i in range(len(self.conns))
                if i not in self.lost and i not in self.starting and i not in self.given_up]

    def start_all(self) -> None:
        """At start-up: every engine loads the model (this waits for them), then they form the sync group."""
        for index in range(len(self.conns)):
            self._spawn(index, replacement=False)
        for index in range(len(self.conns)):
            if self._receive(index, "loaded", None, START_TIMEOUT_S) is None:
                raise EngineLost(f"sampler engine {index} {self.lost[index]}")
        self.starting.clear()
        self.regroup(list(range(len(self.conns))))

    def restart_lost(self) -> dict[int, str]:
        """Starts a replacement for every lost engine (not waiting for it: it loads the model on its own) and
        returns them, engine → why it was lost."""
        lost, self.lost = self.lost, {}
        for index, why in lost.items():
            if self._failed_starts[index] >= MAX_FAILED_STARTS:
                self.given_up[index] = why
                log.error("sampler engine %d: %d replacements in a row failed to start (last: %s); it is given up",
                          index, MAX_FAILED_STARTS, why)
                continue
            self._spawn(index, replacement=True)
        return lost

    def poll_starting(self) -> list[int]:
        """The starting engines that hold the model now (not waiting); one that died or timed out loading is lost
        again (and restarted by the next restart_lost)."""
        for index, since in list(self.starting.items()):
            if index in self.loaded:
                continue
            conn = self.conns[index]
            try:
                message = conn.recv() if conn.poll(0) else None
            except (EOFError, OSError) as exc:
                self._failed_start(index, f"died while loading the model ({type(exc).__name__})")
                continue
            if message is not None and message[0] == "loaded":
                self.loaded.add(index)
            elif time.monotonic() - since > START_TIMEOUT_S:
                self._failed_start(index, f"did not load the model within {START_TIMEOUT_S:g} s")
        return sorted(self.loaded)

    def admitted(self, index: int) -> None:
        """A loaded replacement joined the group and caught up: it is live."""
        self.starting.pop(index, None)
        self.loaded.discard(index)
        self._failed_starts[index] = 0

    def admission_failed(self, indices: list[int]) -> None:
        """Loaded replacements whose admission failed with no other engine to blame (none was lost in it): each
        such failure counts as a failed start, and one that reaches MAX_FAILED_STARTS is lost (restart_lost then
        gives it up) instead of being tried again at every step, each try holding the loop and the live engines in
        a join for the group's timeout."""
        for index in indices:
            if index not in self.loaded:
                continue
            self._failed_starts[index] += 1
            if self._failed_starts[index] >= MAX_FAILED_STARTS:
                self.lose(index, f"could not be admitted (joining the sync group and catching up) "
                                 f"{MAX_FAILED_STARTS} times in a row")

    def _failed_start(self, index: int, why: str) -> None:
        self._failed_starts[index] += 1
        self.starting.pop(index, None)
        self.loaded.discard(index)
        self.lose(index, why)

    def _spawn(self, index: int, replacement: bool) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        tp = self._settings.inference_engine_tensor_parallel_size
        # An engine of inference_engine_tensor_parallel_size ranks: the engine process and its own workers.
        settings = {**dataclasses.asdict(self._settings), "colocate_all": True, "num_inference_engines": 1,
                    "fully_sharded_data_parallel_size": 1, "num_processes": 1, "coordinator_address": "",
                    "tensor_parallel_size": tp,
                    # an engine spreads the experts over its own tensor-parallel ranks, or holds them all
                    "expert_parallel_size": tp if self._settings.expert_parallel_size > 1 else 1,
                    "inference_engine_tensor_parallel_size": 1, "inference_engine_devices": (),
                    "device": sampler_device(self._settings, index)}
        proc = context.Process(target=sampler_engine_main,
                               args=(str(self._model_dir), settings, index, child, self._sync_on_cuda, replacement),
                               # a daemon may not start processes: a tensor-parallel engine starts its ranks
                               # (they die with it: PR_SET_PDEATHSIG; close() stops it)
                               daemon=tp == 1, name=f"skyrl-tx-sampler-{index}")
        proc.start()
        child.close()  # the child's end lives in the child: its death then reads as EOF here
        self.conns[index], self.procs[index] = parent, proc
        self.heard[index] = time.monotonic()
        self.starting[index] = time.monotonic()

    # ---- the sync group ------------------------------------------------------------------------------
    def regroup(self, members: list[int]) -> None:
        """A fresh sync group of the trainer and `members` (engines that hold the model), the old one dropped first:
        a member still blocked in it then gets an error instead of waiting out the timeout. Raises EngineLost (the
        engine is marked lost) when a member does not join."""
        from skyrl_tx.ports import free_local_port

        self.sync, self.members = None, []
        if not members:
            return
        self._drop_dead(members, "a regroup")
        width = self._settings.inference_engine_tensor_parallel_size  # each engine rank is a sync-group rank
        world, tag = 1 + len(members) * width, next(self._tags)
        address = f"127.0.0.1:{free_local_port()}"
        for position, index in enumerate(members):
            if not self.send(index, ("regroup", tag, address, 1 + position * width, world, self.group_timeout_s)):
                # (died since _drop_dead: those sent the regroup fail their join after the timeout and say so;
                # they wait for the next)
                raise EngineLost(f"sampler engine {index} lost before a regroup")
        try:
            sync = join_sync_group(address, 0, world, self.group_timeout_s, device=self._sync_device)
        except InternalError as exc:
            for index in members:  # the ones that answer failed too; the ones that do not are lost
                self._receive(index, "regrouped", tag, self.group_timeout_s)
            raise EngineLost(str(exc)) from exc
        for index in members:
            answer = self._receive(index, "regrouped", tag, self.group_timeout_s)
            if answer is None or answer[2] is not None:
                self.lose(index, f"failed to join the sync group: {answer[2] if answer else self.lost.get(index)}")
                raise EngineLost(f"sampler engine {index} {self.lost[index]}")
        self.sync, self.members = sync, list(members)

    def broadcast(self, snapshot_id: str, sent: dict[str, Any], lora: dict[str, Any] | None, resync: bool,
                  version: int) -> list[tuple]:
        """One sync to every member; their ("synced", tag, snapshot_id, error, digest) answers. Raises EngineLost
        when a member is lost on the way (after dropping the group, so that no survivor stays blocked in it, and
        reading every survivor's answer)."""
        tag = next(self._tags)
        members = list(self.members)
        self._drop_dead(members, "a weight sync")
        for position, index in enumerate(members):
            if not self.send(index, ("sync", tag, snapshot_id, lora, resync)):
                self._abandon(members[:position], tag)  # only those sent the sync answer it
                raise EngineLost(f"sampler engine {index} {self.lost.get(index)}")
        try:
            self.sync.sync(version, sent, self._sync_device)
        except InternalError as exc:  # a collective failed: a member died or hung
            self._abandon(members, tag)
            raise EngineLost(str(exc)) from exc
        answers = []
        for index in members:
            answer = self._receive(index, "synced", tag, self.timeout_s)
            if answer is None:
                self._abandon(members, tag)
                raise EngineLost(f"sampler engine {index} {self.lost.get(index)}")
            answers.append(answer)
        return answers

    def _drop_dead(self, members: list[int], what: str) -> None:
        """Raises EngineLost (the dead marked lost) if a member died unnoticed (nothing in flight on it), before any
        member is sent a command: one sent a sync or a regroup the others cannot complete would block in it until
        the group's timeout, and the trainer would wait for its answer (and could take it for hung)."""
        dead = [index for index in members if index in self.lost or not self.procs[index].is_alive()]
        for index in dead:
            if index in self.starting:  # a loaded replacement that died before it was admitted: a failed start
                self._failed_start(index, f"died before {what} that would have admitted it")
            else:
                self.lose(index, f"found dead before {what}")
        if dead:
            raise EngineLost(f"sampler engine(s) {dead} found dead before {what}")

    def _abandon(self, members: list[int], tag: int) -> None:
        """A sync that failed: the group goes (a survivor blocked in it gets an error), every member still running
        answers (those that do not within the timeout are lost), and the next sync regroups first."""
        self.sync, self.members = None, []
        for index in members:
            if index in self.lost:
                continue
            if not self.procs[index].is_alive():
                self.lose(index, "died during a weight sync")
                continue
            self._receive(index, "synced", tag, self.timeout_s)

    # ---- pipes ---------------------------------------------------------------------------------------
    def send(self, index: int, message: tuple) -> bool:
        """False when the engine is lost (now or before)."""
        if index in self.lost or index in self.given_up:
            return False
        try:
            self.conns[index].send(message)
            return True
        except OSError as exc:  # BrokenPipeError: it died since the last message
            self.lose(index, f"gone ({type(exc).__name__}: {exc})")
            return False

    def recv(self, index: int) -> tuple | None:
        """The engine's next message; None when it is lost."""
        try:
            message = self.conns[index].recv()
        except (EOFError, OSError) as exc:
            self.lose(index, f"gone ({type(exc).__name__}: {exc})")
            return None
        self.heard[index] = time.monotonic()
        return message

    def _receive(self, index: int, kind: str, tag: int | None, timeout_s: float) -> tuple | None:
        """The next message of `kind` (with `tag`, when given) from engine `index`; anything else arriving first
        goes to `on_message` (results are kept). None when it is lost or silent for `timeout_s`."""
        while index not in self.lost:
            if not self.conns[index].poll(timeout_s):
                self.lose(index, f"hung: no answer within {timeout_s:g} s")
                break
            message = self.recv(index)
            if message is not None and message[0] == kind and (tag is None or message[1] == tag):
                return message
            if message is not None and message[0] not in ("regrouped", "synced"):  # those: answers abandoned
                self.on_message(index, message)
        return None

    def receive(self, index: int, kind: str, tag: int | None = None) -> tuple:
        answer = self._receive(index, kind, tag, self.timeout_s)
        if answer is None:
            raise EngineLost(f"sampler engine {index} {self.lost.get(index)}")
        return answer

    on_message: Callable[[int, tuple], None] = staticmethod(lambda index, message: None)  # set by the owner

    def lose(self, index: int, why: str) -> None:
        """Marks an engine lost (killing it, if it still runs); restart_lost starts its replacement."""
        if index in self.lost:
            return
        self.lost[index] = why
        self.starting.pop(index, None)
        self.loaded.discard(index)
        if index in self.members:  # the group lacks a member now: the next sync regroups
            self.sync, self.members = None, []
        self.procs[index].kill()
        log.warning("sampler engine %d (pid %s) is %s; it will be replaced", index, self.procs[index].pid, why)

    def close(self) -> None:
        for index, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            if proc is None:
                continue
            if index not in self.lost:
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
