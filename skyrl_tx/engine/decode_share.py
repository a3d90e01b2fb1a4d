"""DecodeShare: how the engine loop splits device time between training passes and decoding (sampling_share)."""

from __future__ import annotations

import time
from collections.abc import Callable

# Training and sampling share the device: after a training pass of T s, decoding is owed T * share / (1 - share)
# s (backend-config sampling_share), paid before the next pass, so that neither starves the other.
DEFAULT_SAMPLING_SHARE = 0.5
MAX_DECODE_CREDIT_S = 10.0  # bounds what one very long training pass can make the next one wait
DECODE_SLICE_S = 0.05  # decode this long at most between scans, so new samples join the running batch


class DecodeShare:
    """The decode time training owes the samplers (its credit), earned by training passes and paid by decode steps.
    Only the engine loop's thread uses it; it reads the clock through this module's `time` (tests replace it)."""

    def __init__(self, share: float = DEFAULT_SAMPLING_SHARE):
        self.share = share
        self.credit_s = 0.0  # decode time owed to samplers by the training that ran meanwhile

    def training_may_run(self, sampling: bool) -> bool:
        """Training waits while decoding is owed time and samples are running."""
        return self.credit_s <= 0 or not sampling

    def train(self, run: Callable[[], int]) -> int:
        """Runs `run` (training passes and barriers; returns how many requests ran) and adds the decode time it
        owes to the credit."""
        started = time.perf_counter()
        trained = run()
        if trained:
            owed = (time.perf_counter() - started) * self.share / (1.0 - self.share)
            self.credit_s = min(self.credit_s + owed, MAX_DECODE_CREDIT_S)
        return trained

    def decode(self, step: Callable[[], object], sampling: Callable[[], bool], arrived: Callable[[], bool]) -> bool:
        """One decode `step`, then more while decoding is owed device time by the training passes before it, in
        slices of at most DECODE_SLICE_S so that new samples join the batch between them. Returns whether it
        decoded (nothing does while no sample runs)."""
        if not sampling():
            self.credit_s = 0.0  # nothing to decode: training owes nobody
            return False
        deadline = time.perf_counter() + DECODE_SLICE_S
        while True:
            started = time.perf_counter()
            step()
            self.credit_s = max(self.credit_s - (time.perf_counter() - started), 0.0)
            if (self.credit_s <= 0 or not sampling() or time.perf_counter() >= deadline
                    or arrived()):  # a new request (often the next sample of a client just served): scan
                return True
