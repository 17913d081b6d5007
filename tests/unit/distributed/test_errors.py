"""A rank's collective error after a peer's node died reads as that loss, in one line (issue 30 item 4)."""

from __future__ import annotations

from relayrl.distributed.errors import WorkerDiedError, node_loss_error, says_peer_lost, unnamed_peer_loss

GLOO = RuntimeError(  # what a gloo rank raises when the other end of its pair is gone
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:14247. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error."
)
POLICY, GENERATION = ["a" * 56, "b" * 56], ["c" * 56]
PLACEMENTS = [("PolicyWorker", POLICY), ("GenerationWorker", GENERATION)]


def test_a_lost_peer_is_named_by_the_rank_that_was_on_the_dead_node() -> None:
    lost = node_loss_error(GLOO, "PolicyWorker rank 1", "broadcast_weights", PLACEMENTS, {"c" * 56: "10.0.0.3"})
    assert isinstance(lost, WorkerDiedError) and lost.__cause__ is GLOO
    assert str(lost) == (
        "rank 0 (GenerationWorker, node 10.0.0.3, node id cccccccccccc) died with its Ray node: PolicyWorker rank 1 "
        "lost its peer during 'broadcast_weights' (Connection closed by peer)"
    )
    # the CLI prints the part from "rank " of a line that says "died" (tests/integration/test_ray_multinode.py)
    assert "\n" not in str(lost) and " died" in str(lost)


def test_other_errors_and_losses_without_a_dead_node_stay_as_they_are() -> None:
    dead = {"b" * 56: "10.0.0.2"}
    assert node_loss_error(ValueError("logits has NaN"), "PolicyWorker rank 0", "train", PLACEMENTS, dead) is None
    assert node_loss_error(GLOO, "PolicyWorker rank 0", "train", PLACEMENTS, {}) is None  # no node is known dead
    assert says_peer_lost(GLOO) and says_peer_lost(OSError("[Errno 104] Connection reset by peer"))
    assert not says_peer_lost(RuntimeError("CUDA out of memory"))


def test_a_lost_peer_nobody_can_name_is_still_one_line() -> None:
    """The dead peer was idle (no call on it to fail) and Ray has not yet called its node dead: the rank's error is
    still read as a loss, in one line the CLI prints (a rank line that says "died"), with the transport's words."""
    lost = unnamed_peer_loss(GLOO, "rank 1 (PolicyWorker)", "train", 30.0)
    assert isinstance(lost, WorkerDiedError) and lost.__cause__ is GLOO
    assert str(lost) == (
        "rank 1 (PolicyWorker) lost its peer during 'train' (Connection closed by peer): a rank, or the node of one, "
        "died and Ray named neither within 30s"
    )
    assert "\n" not in str(lost) and " died" in str(lost) and str(lost).startswith("rank 1 (PolicyWorker)")
    assert unnamed_peer_loss(ValueError("logits has NaN"), "PolicyWorker rank 0", "train", 30.0) is None
