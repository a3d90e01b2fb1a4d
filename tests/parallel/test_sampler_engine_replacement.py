"""A lost sampler engine stalls no one (issue 37 item 5). Its replacement is held before it loads the model (the
SKYRL_TX_TEST_SAMPLER_START_GATE hook of parallel/sampler_engine_process.py) for as long as the test wants, so what
goes on meanwhile holds by construction, not by timing: another user trains and syncs new sampler weights through
the SDK, and the surviving engine serves every sample, the lost engine's included. Once released, the replacement
joins the sync group, catches up on every version (the one synced while it was held too) and serves the same
tokens; every request returns exactly once. Then the other engine dies inside a weight sync (the
SKYRL_TX_TEST_SAMPLER_SYNC_EXIT hook): the sync completes for the survivor, with no restart of the engine process."""

from __future__ import annotations

import os
import re
import signal

from live_server import live_server

CONFIG = {"colocate_all": False, "generator.inference_engine.num_engines": 2,
          "inference_engine_devices": ["cpu", "cpu"]}
RESULT_TIMEOUT_S = 120  # a bound, so a loop stalled by the held replacement fails the test instead of hanging it
SYNC_LINE = re.compile(r"weight sync \d+: \S+ .* to (\d) sampler engine\(s\) .*so far: \[(\d+), (\d+)\]")


def _tokens(futures) -> list[list[int]]:
    return [list(f.result(timeout=RESULT_TIMEOUT_S).sequences[0].tokens) for f in futures]


def test_training_and_the_other_engine_go_on_while_a_lost_engine_is_replaced(preset_cache, tmp_path) -> None:
    import tinker
    from engine_processes import spawned_children
    from tinker import types

    from skyrl_tx.bench.api import _engine_pid

    gate = tmp_path / "release-the-replacement"
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [types.ModelInput.from_ints([5 + i, 17, 3 + i % 7]) for i in range(40)]
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 14))),
                        loss_fn_inputs={"target_tokens": list(range(6, 15)), "weights": [1.0] * 9})]
    adam = types.AdamParams(learning_rate=1e-2)
    exit_in_sync = tmp_path / "exit-in-sync-"  # + the engine's index: it exits inside the next sync
    hooks = {"SKYRL_TX_TEST_SAMPLER_START_GATE": str(gate), "SKYRL_TX_TEST_SAMPLER_SYNC_EXIT": str(exit_in_sync)}
    with live_server(backend_config=CONFIG, env=hooks) as url:
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-replace", TINKER_TELEMETRY="0")
        try:
            with tinker.ServiceClient() as service:
                a = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
                a.forward_backward(data, "cross_entropy").result()
                a.optim_step(adam).result()
                sampler_a = a.save_weights_and_get_sampling_client().result()
                b = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=2).result()
                engine = _engine_pid(url)
                first = spawned_children(engine)
                assert len(first) == 2, first
                futures = [sampler_a.sample(p, 1, params) for p in prompts[:20]]
                os.kill(first[0], signal.SIGKILL)
                futures += [sampler_a.sample(p, 1, params) for p in prompts[20:]]
                # The replacement is held before it loads: user b trains two steps and syncs a new version (to the
                # surviving engine alone), samples it, and every sample of a completes on the survivor.
                for _ in range(2):
                    b.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
                    b.optim_step(adam).result(timeout=RESULT_TIMEOUT_S)
                sampler_b = b.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
                held_b = _tokens([sampler_b.sample(p, 1, params) for p in prompts[:8]])
                held_a = _tokens(futures)
                log_held = url.log_path.read_text(errors="replace")
                children_held = spawned_children(engine)
                gate.touch()
                # Released: it loads, and joins at a sample step; sample until the log says it was admitted.
                _sample_until_admitted(url, sampler_a, prompts[0], params, "{0: ")
                calm_a = _tokens([sampler_a.sample(p, 1, params) for p in prompts])
                calm_b = _tokens([sampler_b.sample(p, 1, params) for p in prompts[:8]])
                # Engine 1 exits inside the next sync (the trainer is in the broadcast): the save still succeeds,
                # its version reaching engine 0, and samples the same before and after engine 1 is replaced.
                exit_in_sync.with_name(exit_in_sync.name + "1").touch()
                b.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
                b.optim_step(adam).result(timeout=RESULT_TIMEOUT_S)
                sampler_b2 = b.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
                one_engine_b2 = _tokens([sampler_b2.sample(p, 1, params) for p in prompts[:8]])
                _sample_until_admitted(url, sampler_b2, prompts[0], params, "{1: ")
                calm_b2 = _tokens([sampler_b2.sample(p, 1, params) for p in prompts])
                b.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)  # a sync to both again
                # No engine live: both killed while their replacements are held. Training and a save go on (the
                # version is kept for the replacements), and samples wait for an engine instead of failing.
                gate.unlink()
                for pid in spawned_children(engine):
                    os.kill(pid, signal.SIGKILL)
                waiting = [sampler_b2.sample(p, 1, params) for p in prompts[:4]]
                b.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
                b.optim_step(adam).result(timeout=RESULT_TIMEOUT_S)
                sampler_b3 = b.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
                waiting_b3 = [sampler_b3.sample(p, 1, params) for p in prompts[:4]]
                none_live = not any(f.future().done() for f in waiting + waiting_b3)  # held: none could run
                gate.touch()
                after_none_live = _tokens(waiting)
                b3 = _tokens(waiting_b3)
                calm_b3 = _tokens([sampler_b3.sample(p, 1, params) for p in prompts[:4]])
        finally:
            gate.touch()  # a failed assertion must not leave the replacement held
        log = url.log_path.read_text(errors="replace")
        assert _engine_pid(url) == engine, log[-3000:]  # the engine process never restarted
    # While held: the replacement ran (spawned) but had not loaded, the lost engine's requests went to the survivor,
    # and b's version was synced to one engine.
    assert first[0] not in children_held and first[1] in children_held and len(children_held) == 2, children_held
    assert "replaced sampler engine(s)" not in log_held, log_held[-3000:]
    assert re.search(r"sampler engine\(s\) \[0\] lost: a replacement loads the model in the background; \d+ "
                     r"request\(s\) sent to engine\(s\) \[1\]", log_held), log_held[-3000:]
    syncs = [(int(m[1]), int(m[2]), int(m[3])) for m in SYNC_LINE.finditer(log)]
    # a's version, b's while 0 was held, b's when 1 exited inside it (sent again to 0 alone), b's after
    assert [engines for engines, _, _ in syncs] == [2, 1, 1, 2], syncs
    # Every request returned exactly once, with its own prompt's tokens: the same as once things were calm again,
    # when both engines serve (the replacement caught up on both versions: a's and the one synced while it was held).
    assert len(held_a) == len(prompts) and held_a == calm_a
    assert held_b == calm_b
    assert syncs[2][1] > syncs[1][1], syncs  # the replacement of engine 0 served requests after it was admitted
    assert "replaced sampler engine(s) {0: " in log, log[-3000:]
    # The sync engine 1 died in completed for engine 0, without a restart; engine 1's replacement got that version.
    assert "sampler engine lost while" in log and "sending it again to the live ones [0]" in log, log[-3000:]
    assert "replaced sampler engine(s) {1: " in log, log[-3000:]
    assert one_engine_b2 == calm_b2[:8] and one_engine_b2 != calm_b
    assert syncs[3][2] > syncs[2][2], syncs  # the replacement of engine 1 served requests after it was admitted
    # With no engine live, the samples waited and then ran on the replacements, which caught up on the version
    # saved meanwhile.
    assert none_live and after_none_live == calm_b2[:4] and b3 == calm_b3, (after_none_live, b3, calm_b3)
    assert "kept for the sampler engines being replaced (none is live)" in log, log[-3000:]


def _sample_until_admitted(url, sampler, prompt, params, engine: str) -> None:
    """Samples (a replacement is admitted at a sample step once it holds the model) until the log says so."""
    for _ in range(500):  # a bound, so a replacement never admitted fails the test instead of hanging it
        if f"replaced sampler engine(s) {engine}" in url.log_path.read_text(errors="replace"):
            return
        _tokens([sampler.sample(prompt, 1, params)])


def test_an_engine_found_dead_at_a_sync_costs_no_other_engine(tiny_model_dir, tmp_path, monkeypatch, caplog) -> None:
    """The backend itself: engine 0 dies while nothing samples (nothing notices), then a snapshot is synced. The sync
    must drop engine 0 and reach engine 1 alone. Before the fix, the trainer sent the sync to the members in order,
    stopped at dead engine 0 and then waited for engine 1's answer to a sync it never sent: engine 1 was declared
    hung after inference_engine_timeout_s and killed (a healthy engine lost, the engine loop blocked meanwhile)."""
    import time

    from skyrl_tx.backend.factory import make_backend
    from skyrl_tx.config import BackendSettings
    from skyrl_tx.types import SampleRequest, SamplingParams

    monkeypatch.setenv("SKYRL_TX_TEST_SAMPLER_START_GATE", str(tmp_path / "never"))  # replacements stay unloaded
    settings = BackendSettings(max_lora_adapters=2, max_lora_rank=4, max_sampling_sequences=4, colocate_all=False,
                               num_inference_engines=2, inference_engine_devices=("cpu", "cpu"),
                               inference_engine_timeout_s=5.0)
    backend = make_backend(tiny_model_dir("tiny-qwen3"), settings)
    pool = backend._pool
    try:
        survivor = pool.procs[1].pid
        os.kill(pool.procs[0].pid, signal.SIGKILL)
        pool.procs[0].join()  # dead for sure before the sync
        backend.create_model("m", lora_rank=4, seed=3)
        with caplog.at_level("WARNING", logger="skyrl_tx.parallel"):
            backend.snapshot("m", "m@1")
        lost_1 = dict(pool.lost), 1 in pool.given_up or pool.procs[1].pid != survivor or 1 in pool.starting
        sample_id = backend.submit_sample(SampleRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0),
                                                        weights_id="m@1"))
        results: dict[int, object] = {}
        for _ in range(2000):  # a bound (a stalled engine fails the test instead of hanging it)
            results.update(backend.sample_step())
            if sample_id in results:
                break
        starting = 0 in pool.starting
        # Engine 0's replacement loads (released), then dies before the step that would admit it: a failed start
        # (counted towards giving it up), not a plain loss that could repeat for ever.
        (tmp_path / "never").touch()
        for _ in range(2400):  # a bound (about 2 minutes)
            if pool.poll_starting():
                break
            time.sleep(0.05)
        os.kill(pool.procs[0].pid, signal.SIGKILL)
        pool.procs[0].join()
        backend._tend()
        failed_starts = pool._failed_starts[0]
    finally:
        backend.close()
    assert lost_1 == ({}, False), (lost_1, caplog.text)  # engine 1 was never lost (0 is being replaced)
    assert "hung" not in caplog.text, caplog.text
    assert starting and pool.procs[1].pid == survivor
    assert failed_starts == 1, caplog.text[-3000:]
    assert len(results[sample_id].sequences[0].tokens) == 4  # served by engine 1, the version synced to it


def test_a_replacement_that_cannot_join_is_given_up_not_tried_forever(tiny_model_dir, tmp_path, monkeypatch,
                                                                      caplog) -> None:
    """The backend itself: engine 0's replacement loads but every join of the sync group fails (the
    SKYRL_TX_TEST_SAMPLER_JOIN_FAIL hook). Each admission attempt holds the engine loop and the live engine in a join
    for the group's timeout; after MAX_FAILED_STARTS such attempts it is given up, while engine 1 serves. Before the
    fix it was tried again at every sample step, for ever (never counted as a failed start)."""
    import time

    from skyrl_tx.backend.factory import make_backend
    from skyrl_tx.config import BackendSettings
    from skyrl_tx.parallel.sampler_engine_pool import MAX_FAILED_STARTS
    from skyrl_tx.types import SampleRequest, SamplingParams

    refuse = tmp_path / "refuse-join"
    refuse.touch()
    monkeypatch.setenv("SKYRL_TX_TEST_SAMPLER_JOIN_FAIL", str(refuse))
    caplog.set_level("WARNING", logger="skyrl_tx.parallel")
    settings = BackendSettings(max_lora_adapters=2, max_lora_rank=4, max_sampling_sequences=4, colocate_all=False,
                               num_inference_engines=2, inference_engine_devices=("cpu", "cpu"))
    backend = make_backend(tiny_model_dir("tiny-qwen3"), settings)
    pool = backend._pool
    pool.group_timeout_s = 2.0  # what each failed admission holds the loop for (60 s at least in a server)
    failed = "admitting the replaced sampler engine(s) [0] failed"
    try:
        survivor = pool.procs[1].pid
        os.kill(pool.procs[0].pid, signal.SIGKILL)
        request = SampleRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
        results: dict[int, object] = {backend.submit_sample(request): None}  # its step notices engine 0's death
        for _ in range(2400):  # a bound (about 2 minutes), so attempts without end fail the test instead of hanging it
            if 0 in pool.given_up or caplog.text.count(failed) > MAX_FAILED_STARTS:
                break
            if all(results.values()):  # something in flight, so that steps drain the engines' pipes
                results[backend.submit_sample(request)] = None
            results.update(backend.sample_step())
            time.sleep(0.05)
        engine_1 = 1 not in pool.lost and 1 not in pool.given_up and pool.procs[1].pid == survivor
        served = [r for r in results.values() if r is not None]  # (one still in flight fails below with `last`)
        # Then engine 1 dies (unnoticed: the request below is still sent to it) and its replacement cannot join
        # either: once it is given up too, the request fails with a clear server error instead of waiting for ever.
        os.kill(pool.procs[1].pid, signal.SIGKILL)
        pool.procs[1].join()
        last = backend.submit_sample(request)
        for _ in range(2400):  # a bound (about 2 minutes)
            results.update(backend.sample_step())
            if last in results:
                break
            time.sleep(0.05)
    finally:
        refuse.unlink()
        backend.close()
    assert caplog.text.count(failed) == MAX_FAILED_STARTS and 0 in pool.given_up, caplog.text[-3000:]
    assert engine_1, caplog.text[-3000:]
    error = getattr(results.pop(last, None), "error", None)
    assert error is not None and error.category == "server" and "no sampler engine is left" in str(error), error
    assert set(pool.given_up) == {0, 1}
    assert served and all(len(r.sequences[0].tokens) == 4 for r in served)  # engine 1 served meanwhile
