"""FutureWaiters: a finished future wakes every long-poll waiting for it, with the outcome, and only those."""

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
