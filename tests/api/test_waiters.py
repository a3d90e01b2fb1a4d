"""FutureWaiters: a finished future wakes every long-poll waiting for it, with the outcome, and only those; a
finished sample wakes the retrieve_futures polls of its completion queue."""

from __future__ import annotations

import asyncio
import threading

from skyrl_tx.api.waiters import FutureWaiters
from skyrl_tx.db.future_queries import FutureOutcome


def test_outcome_reaches_every_waiter_of_its_future_from_another_thread() -> None:
    async def scenario() -> None:
        waiters = FutureWaiters()
        waiters.bind(asyncio.get_running_loop())
        first, second, other = waiters.register("a"), waiters.register("a"), waiters.register("b")
        done = FutureOutcome("a", "completed", "optim_step", {"metrics": {"loss": 1.5}}, None)
        engine = threading.Thread(target=waiters.notify_threadsafe, args=([done],))  # as the engine's thread does
        engine.start()
        await asyncio.wait_for(asyncio.gather(first.event.wait(), second.event.wait()), timeout=5)
        engine.join()
        assert first.outcome == done and second.outcome == done
        assert not other.event.is_set() and other.outcome is None
        for future_id, waiter in (("a", first), ("a", second), ("b", other)):
            waiters.unregister(future_id, waiter)
        waiters._deliver([done])  # nobody waits any more: dropped (the database has it), nothing kept
        assert not waiters._waiting

    asyncio.run(scenario())


def test_a_finished_sample_wakes_the_polls_of_its_completion_queue_only() -> None:
    """retrieve_futures polls one (sampling session, cloned sampler) queue: seq_ids 0..1e9-1 are clone 0's."""
    async def scenario() -> None:
        waiters = FutureWaiters()
        waiters.bind(asyncio.get_running_loop())
        clone0, clone2, other = (waiters.register_queue("s:sample:0#0"), waiters.register_queue("s:sample:0#2"),
                                 waiters.register_queue("s:sample:1#0"))
        sample = FutureOutcome("s:sample:0:41", "completed", "sample", {"sequences": []}, None)
        training = FutureOutcome("s:sample:0:7", "completed", "optim_step", {}, None)  # not a sample: no queue
        engine = threading.Thread(target=waiters.notify_threadsafe, args=([training, sample],))
        engine.start()
        await asyncio.wait_for(clone0.event.wait(), timeout=5)
        engine.join()
        assert not clone2.event.is_set() and not other.event.is_set()
        waiters.deliver([FutureOutcome("s:sample:0:2000000005", "failed", "sample", None, {})])  # the API's own
        assert clone2.event.is_set() and not other.event.is_set()
        for queue, waiter in (("s:sample:0#0", clone0), ("s:sample:0#2", clone2), ("s:sample:1#0", other)):
            waiters.unregister_queue(queue, waiter)
        assert not waiters._queues

    asyncio.run(scenario())
