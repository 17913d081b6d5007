"""ProcessGeneration: the engine in a child process samples what the in-process engine samples, refits from a
weights snapshot, round-trips its RNG, and reports a child's error or death in one line."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from relayrl.config import ColocatedConfig, GenerationConfig
from relayrl.models.generation.hf_generation import HfGeneration
from relayrl.models.generation.process_generation import GenerationProcessError, ProcessGeneration
from relayrl.utils.deadlines import DeadlineError
from tests.helpers import build_test_model, tight_deadlines
from tests.unit.models.generation.test_hf_generation import PROMPTS, Source, _batch, _sharpen

CFG = GenerationConfig(max_new_tokens=6, colocated=ColocatedConfig(enabled=False))


@pytest.fixture
def engines(char_tokenizer):
    """(in-process engine, process engine) over the same weights and seed."""
    model = _sharpen(build_test_model(char_tokenizer))
    local = HfGeneration(CFG, char_tokenizer, Source(model), seed=7)
    remote = ProcessGeneration(
        CFG, char_tokenizer, model, 0, max_total_sequence_length=None, seed=7, num_threads=1, deterministic=True
    )
    yield local, remote, model
    remote.shutdown()


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_samples_what_the_in_process_engine_samples(engines, char_tokenizer):
    local, remote, _ = engines
    batch = _batch(char_tokenizer, PROMPTS)
    for _ in range(2):  # the generator advances alike on both sides
        _same(local.generate(batch), remote.generate(batch))
    state = remote.get_rng_state()
    first = remote.generate(batch)
    remote.set_rng_state(state)
    _same(remote.generate(batch), first)


def test_refits_from_a_weights_snapshot(engines, char_tokenizer):
    local, remote, model = engines
    batch = _batch(char_tokenizer, PROMPTS)
    before = remote.generate(batch, greedy=True)
    live = model.state_dict()["lm_head.weight"].clone()
    snapshot = {k: v.detach().clone() * 1.5 for k, v in model.state_dict().items()}
    local.load_weights(snapshot, 3)
    local._source.weights_version = 3
    remote.load_weights(snapshot, 3)
    after = remote.generate(batch, greedy=True)
    _same(local.generate(batch, greedy=True), after)
    assert not torch.equal(before["output_ids"], after["output_ids"])
    assert torch.equal(model.state_dict()["lm_head.weight"], live)  # the live module is never touched


def test_an_error_in_the_child_is_one_line_and_the_engine_lives_on(engines, char_tokenizer):
    _, remote, _ = engines
    with pytest.raises(GenerationProcessError, match=r"in generate: ValueError: generate\(\) input is missing"):
        remote.generate(_batch(char_tokenizer, PROMPTS).select_keys(["input_lengths"]))
    assert remote.generate(_batch(char_tokenizer, PROMPTS))["output_ids"].shape[0] == len(PROMPTS)


def test_a_dead_child_is_reported_with_its_exit_code(engines, char_tokenizer):
    _, remote, _ = engines
    os.kill(remote._proc.pid, signal.SIGKILL)
    remote._proc.join(timeout=10)
    with pytest.raises(GenerationProcessError, match=r"generation process exited \(code -9\)"):
        remote.generate(_batch(char_tokenizer, PROMPTS))
    assert remote.shutdown()


def test_refits_go_through_one_staging_copy(engines, char_tokenizer):
    """Each refit writes the snapshot into the shared-memory copy made at start (never a new one) and the child loads
    that: two refits in a row sample what the in-process engine samples after the same refits."""
    local, remote, model = engines
    batch = _batch(char_tokenizer, PROMPTS)
    staged = {k: t.data_ptr() for k, t in remote._staging.tensors.items()}
    assert staged["lm_head.weight"] == staged["model.embed_tokens.weight"]  # tied: staged once
    for version, scale in ((1, 1.5), (2, 0.5)):
        snapshot = {k: v.detach().clone() * scale for k, v in model.state_dict().items()}
        local.load_weights(snapshot, version)
        local._source.weights_version = version
        remote.load_weights(snapshot, version)
        assert {k: t.data_ptr() for k, t in remote._staging.tensors.items()} == staged
        _same(remote._staging.tensors, snapshot)
        _same(local.generate(batch, greedy=True), remote.generate(batch, greedy=True))


def test_a_snapshot_of_other_weights_is_refused_in_one_line(engines, char_tokenizer):
    _, remote, model = engines
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    snapshot.pop("lm_head.weight")
    with pytest.raises(
        GenerationProcessError, match=r"in load_weights: RuntimeError: Error\(s\) in loading state_dict"
    ):
        remote.load_weights(snapshot, 1)
    assert remote.generate(_batch(char_tokenizer, PROMPTS))["output_ids"].shape[0] == len(PROMPTS)


def test_a_hung_child_ends_the_call_and_the_request_waiting_behind_it(char_tokenizer, monkeypatch):
    """Issue 28 item 5: a child that stops answering (SIGSTOP: a real hang) ends the pipe's wait with one line
    naming the call, the pid and cluster.call_timeout_s; a second request waiting for the first's lock ends with
    one line under cluster.wait_timeout_s; shutting the engine down afterwards does not wait for the child."""
    tight_deadlines(monkeypatch, call_timeout_s=2.0, wait_timeout_s=0.2)  # the lock wait ends well before the call
    remote = ProcessGeneration(
        CFG, char_tokenizer, build_test_model(char_tokenizer), 0, max_total_sequence_length=None, seed=7,
        num_threads=1, deterministic=True,
    )  # fmt: skip
    pid = remote._proc.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            remote.generate(_batch(char_tokenizer, PROMPTS))
        except DeadlineError as exc:
            errors.append(exc)

    def lock_taken() -> bool:  # by the generate call's thread (an RLock: probed from a third thread)
        taken: list[bool] = []

        def probe_lock() -> None:  # an RLock is released by the thread that acquired it
            got = remote._lock.acquire(blocking=False)
            taken.append(got)
            if got:
                remote._lock.release()

        probe = threading.Thread(target=probe_lock)
        probe.start()
        probe.join()
        return not taken[0]

    caller = threading.Thread(target=generate, daemon=True)
    try:
        caller.start()
        deadline = time.monotonic() + 30
        while not lock_taken() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(DeadlineError) as err:
            remote.get_rng_state()
        assert str(err.value) == (
            "the generation process's request lock (for 'get_rng_state') did not finish within 0.2s "
            "(cluster.wait_timeout_s)"
        )
        caller.join(30)
        assert [str(e) for e in errors] == [
            f"the generation process's 'generate' (pid {pid}) did not finish within 2s (cluster.call_timeout_s)"
        ]
    finally:
        os.kill(pid, signal.SIGCONT)
        start = time.monotonic()
        remote.shutdown()
        assert time.monotonic() - start < 10 and not remote._proc.is_alive()
