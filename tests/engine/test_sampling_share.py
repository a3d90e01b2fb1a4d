"""Training does not starve sampling: with trainers looping and samples decoding, the engine keeps decoding for
the backend-config `sampling_share` of device time (compared with share 0, one decode step per training pass)."""

from __future__ import annotations

import time

from engine_rows import add, create, future, results

MODEL = "s:train:0"
TOKENS = list(range(5, 69))  # 64 tokens per datum: a training pass costs many decode steps here


def _fb(seq_id: int):
    datum = {"input_tokens": TOKENS[:-1], "loss_fn_inputs": {
        "target_tokens": {"dtype": "int64", "shape": [63], "values": TOKENS[1:]},
        "weights": {"dtype": "float32", "shape": [63], "values": [1.0] * 63}}}
    body = {"model_id": MODEL, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [datum] * 8}
    return future(f"{MODEL}:{seq_id}", "forward_backward", body, MODEL, seq_id)


def _decode_fraction(loop, share: float, passes: int = 6) -> float:
    """Time in decode steps / time in decode steps + training passes, while a trainer loops and samples run."""
    loop.sampling_share = share
    spent = {"train": 0.0, "decode": 0.0}
    backend = loop.backend

    def timed(kind, fn):
        def run(*args):
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[kind] += time.perf_counter() - started
        return run

    loop.backend.forward_backward = timed("train", backend.forward_backward)
    loop.backend.sample_step = timed("decode", backend.sample_step)
    create(loop, "s", MODEL)
    prompt = {"prompt_tokens": [5, 6, 7], "num_samples": 1, "weights_id": "",
              "sampling_params": {"max_tokens": 1500, "temperature": 1.0, "seed": 1}}
    add(loop, *[future(f"sample-{i}", "sample", prompt) for i in range(4)])
    loop.step()
    for seq_id in range(1, passes + 1):  # a trainer that sends its next batch as soon as the last one finished
        add(loop, _fb(seq_id))
        while results(loop)[f"{MODEL}:{seq_id}"].status != "completed":
            loop.step()
    assert all(results(loop)[f"sample-{i}"].status in ("pending", "running") for i in range(4)), \
        "the samples finished early: the measurement needs them decoding throughout"
    fraction = spent["decode"] / (spent["decode"] + spent["train"])
    print(f"sampling_share {share}: decode {fraction:.0%} of decode + training time")
    return fraction


def test_decoding_keeps_its_share_while_a_trainer_loops(loop) -> None:
    kept = _decode_fraction(loop, share=0.5)
    assert kept >= 0.4, f"decode had {kept:.0%} of the device with sampling_share 0.5"


def test_share_zero_is_one_decode_step_per_training_pass(loop) -> None:
    """The peer run: without a share, a training pass is followed by one decode step, so decoding gets far less."""
    assert _decode_fraction(loop, share=0.0) < 0.3
