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
