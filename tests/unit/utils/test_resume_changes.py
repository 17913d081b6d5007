"""Which config changes keep a resumed run exact: where the ranks run is not what they compute."""

from __future__ import annotations

from relayrl.utils.config_io import classify_resume_changes, load_config


def test_a_new_cluster_address_is_resume_safe_and_a_new_world_size_is_not() -> None:
    ray = ["cluster.executor=ray", "policy.train_micro_batch_size=8"]
    old = load_config(None, [*ray, "cluster.workers_per_node=2"])
    moved = load_config(None, [*ray, "cluster.workers_per_node=2", "cluster.ray_address=10.0.0.5:6379"])
    safe, inexact, restored = classify_resume_changes(old, moved)
    assert safe == [("cluster.ray_address", None, "10.0.0.5:6379")] and inexact == [] and restored == []
    grown = load_config(None, [*ray, "cluster.workers_per_node=4"])
    safe, inexact, _ = classify_resume_changes(old, grown)
    assert safe == [] and [k for k, *_ in inexact] == ["cluster.workers_per_node"]


def test_placement_only_keys_are_resume_safe() -> None:
    """The CPUs per actor and where generation runs (colocated or on nodes of its own) move the work,
    not the numbers: the resumed run's metrics equal one node's (test_ray_multinode.py resumes on a new cluster
    with generation moved to a node of its own). The world size and the device are not placement."""
    base = ["cluster.executor=ray", "cluster.workers_per_node=2", "policy.train_micro_batch_size=8"]
    old = load_config(None, base)
    moved = load_config(
        None,
        [
            *base,
            "cluster.cpus_per_worker=2",
            "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.num_nodes=1",
            "policy.generation.colocated.resources.workers_per_node=1",
        ],
    )
    safe, inexact, restored = classify_resume_changes(old, moved)
    assert sorted(k for k, *_ in safe) == [
        "cluster.cpus_per_worker",
        "policy.generation.colocated.enabled",
        "policy.generation.colocated.resources.num_nodes",
        "policy.generation.colocated.resources.workers_per_node",
    ]
    assert inexact == [] and restored == []
    _, inexact, _ = classify_resume_changes(old, load_config(None, [*base, "cluster.device=cpu"]))
    assert [k for k, *_ in inexact] == ["cluster.device"]
