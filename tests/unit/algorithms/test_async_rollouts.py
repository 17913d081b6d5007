"""The async producer's hand-offs have deadlines (issue 28 item 5): a producer thread that hangs (here: on a loader
that never yields) ends the trainer's wait for its next batch, the join that stops it, and a pause that waits for
its engine, each with one line naming the wait, the deadline and `cluster.wait_timeout_s`."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from relayrl.algorithms.async_rollouts import LookaheadLoader, ProducerState, RolloutProducer
from relayrl.config import MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.utils.deadlines import DeadlineError
from tests.helpers import tight_deadlines


class HangingLoader:
    """A train loader whose first batch never comes (a stuck dataset read) until `release` is set."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __iter__(self) -> Iterator[BatchedDataDict]:
        self.entered.set()
        self.release.wait(60)
        return iter(())

    def __len__(self) -> int:
        return 1

    def state_dict(self) -> dict[str, object]:
        return {"position": 0}


@pytest.fixture
def hung(monkeypatch):
    tight_deadlines(monkeypatch, wait_timeout_s=0.2)
    loader = HangingLoader()
    # actor, engine and client are never reached: the producer hangs before its first batch
    producer = RolloutProducer(
        actor=None,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        pin=None,
        client=None,  # type: ignore[arg-type]
        loader=loader,
        cfg=MasterConfig(),
        state=ProducerState(next_index=1, epoch=0, version=0),
        carry_keys=[],
    )
    producer.start()
    assert loader.entered.wait(30)
    yield producer, loader
    loader.release.set()
    producer.stop()


def test_the_trainers_waits_on_a_hung_producer_end_with_one_line(hung) -> None:
    producer, _ = hung
    with pytest.raises(DeadlineError) as err:
        next(iter(LookaheadLoader(producer, producer.loader)))
    assert str(err.value) == (
        "the trainer's wait for the rollout producer's next batch of prompts (after batch 0) did not finish within "
        "0.2s (cluster.wait_timeout_s)"
    )
    with pytest.raises(DeadlineError, match=r"^the trainer's wait for batch 1 from the rollout producer did not "):
        producer.take(1)


def test_stopping_a_hung_producer_ends_its_join(hung) -> None:
    producer, _ = hung
    with pytest.raises(DeadlineError) as err:
        producer.stop()
    assert str(err.value) == (
        "stopping the rollout producer (joining its thread) did not finish within 0.2s (cluster.wait_timeout_s)"
    )


def test_a_pause_waiting_for_a_batch_in_progress_ends(hung) -> None:
    producer, _ = hung
    holding, done = threading.Event(), threading.Event()

    def batch_in_progress() -> None:  # holds the engine as a batch's refit and generation do
        with producer.paused():
            holding.set()
            done.wait(30)

    worker = threading.Thread(target=batch_in_progress, daemon=True)
    worker.start()
    assert holding.wait(30)
    try:
        with pytest.raises(DeadlineError) as err, producer.paused():
            pass
        assert str(err.value) == (
            "pausing the rollout producer (its batch in progress) did not finish within 0.2s (cluster.wait_timeout_s)"
        )
    finally:
        done.set()
        worker.join(30)
