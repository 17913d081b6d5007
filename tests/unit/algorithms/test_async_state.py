"""Async GRPO's checkpoint of rollouts in flight: rows, carry and tags round-trip exactly through the state file (or,
with `checkpointing.save_data_plane`, through the checkpoint's data-plane store, reconciled with the state file), and
a resume with a tighter staleness bound drops (and counts) the batches that became too old, later ones with them."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.async_rollouts import CLAIM_TASK, ProducedBatch, ProducerState, partition_for
from relayrl.algorithms.async_state import load_producer_state, restore_batches, save_producer_state
from relayrl.config import MasterConfig
from relayrl.data_plane.column_io import first_write, read_columns
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, TRAIN_CONSUMER_TASKS
from relayrl.experience.carry_wire import decode_carry, encode_carry
from relayrl.utils.checkpoint import GRPOSaveState
from relayrl.utils.state_file import CheckpointError, load_state_file

G = 2  # generations per prompt


def _client():
    return build_data_plane_client({"enabled": True, "backend": "memory"})


def _batch(client, index: int, version: int, seed: int) -> ProducedBatch:
    """A 2-prompt x 2-generation batch with ragged rows, written the way the rollout actor writes one."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 6, 4])
    rows = {
        "input_ids": torch.randint(1, 50, (4, 8), generator=gen),
        "input_lengths": lengths,
        "generation_logprobs": -torch.rand(4, 8, generator=gen),
        "token_mask": (torch.arange(8) < lengths[:, None]).long(),
        "sample_mask": torch.ones(4),
    }
    pid = partition_for(index)
    client.register_partition(pid, list(DP_TRAIN_FIELDS), 4, [*TRAIN_CONSUMER_TASKS, CLAIM_TASK], G)
    keys = [f"u{index}p{p}_g{i}" for p in range(2) for i in range(G)]
    meta = first_write(rows, keys=keys, client=client, partition_id=pid, tags=[{"weight_version": version}] * 4)
    carry = {"total_reward": torch.tensor([1.0, 0.0, 0.5, 0.5]), "truncated": torch.tensor([False, True, False, False])}
    return ProducedBatch(index, 0, version, meta, encode_carry(carry, G), {"mean_gen_tokens_per_sample": 3.5})


def _cfg(bound: int, save_data_plane: bool = False) -> MasterConfig:
    return MasterConfig.model_validate(
        {
            "checkpointing": {"save_data_plane": save_data_plane},
            "grpo": {
                "num_prompts_per_step": 2,
                "num_generations_per_prompt": G,
                "async_grpo": {"enabled": True, "max_trajectory_age_steps": bound},
            },
            "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 4},
        }
    )


def test_rollouts_in_flight_round_trip_exactly(tmp_path):
    src = _client()
    batches = [_batch(src, 3, 1, seed=3), _batch(src, 4, 2, seed=4)]
    state = ProducerState(next_index=5, epoch=0, version=2, ready=batches, announced=[(0, 3), (0, 4)])
    rng = torch.Generator().manual_seed(7).get_state()
    save_producer_state(tmp_path / "s.safetensors", state, rng, src)

    restored = load_producer_state(tmp_path / "s.safetensors", GRPOSaveState(total_steps=2), _cfg(1))
    loaded = restored.state
    assert restored.dropped_groups == 0 and loaded.next_index == 5 and loaded.announced == [(0, 3), (0, 4)]
    assert torch.equal(restored.rng, rng) and not restored.rows_in_store
    dst = _client()
    restore_batches(restored, dst, G)
    for before, after in zip(batches, loaded.ready):
        assert after.meta.keys == before.meta.keys and after.meta.tags == before.meta.tags
        assert after.meta.sequence_lengths == before.meta.sequence_lengths
        old = read_columns(src, before.meta)
        new = read_columns(dst, after.meta)
        assert all(torch.equal(old[k], new[k]) for k in old)
        c0, c1 = decode_carry(before.wire_carry), decode_carry(after.wire_carry)
        assert all(torch.equal(c0[k], c1[k]) and c0[k].dtype == c1[k].dtype for k in c0)


def test_tighter_bound_drops_stale_batches_and_the_ones_after(tmp_path):
    src = _client()
    # batch 3 by version 0 (age 2 at step 3), batch 4 by version 2 (age 1 at step 4: young enough on its own)
    batches = [_batch(src, 3, 0, seed=1), _batch(src, 4, 2, seed=2)]
    state = ProducerState(next_index=5, epoch=0, version=2, ready=batches, announced=[(0, 3), (0, 4)])
    save_producer_state(tmp_path / "s.safetensors", state, torch.Generator().get_state(), src)

    kept = load_producer_state(tmp_path / "s.safetensors", GRPOSaveState(total_steps=2), _cfg(2))
    assert kept.dropped_groups == 0 and [b.index for b in kept.state.ready] == [3, 4]
    tight = load_producer_state(tmp_path / "s.safetensors", GRPOSaveState(total_steps=2), _cfg(1))
    assert tight.dropped_groups == 4  # both (2 groups each): batches are trained in order, so production restarts at 3
    assert tight.state.ready == [] and tight.state.next_index == 3 and tight.state.announced == []
    assert tight.stale_partitions == [partition_for(3), partition_for(4)]


def _saved_with_store(tmp_path, src, batches):
    """A checkpoint as `checkpointing.save_data_plane=true` writes it: the store in dp/, descriptions in the file."""
    state = ProducerState(next_index=5, epoch=0, version=2, ready=batches, announced=[(0, 3), (0, 4)])
    src.save_checkpoint(tmp_path / "dp")
    save_producer_state(tmp_path / "s.safetensors", state, torch.Generator().get_state(), src, rows_in_store=True)
    assert all("rows" not in b for b in load_state_file(tmp_path / "s.safetensors")["batches"])


def test_rollouts_in_flight_round_trip_through_the_data_plane_checkpoint(tmp_path):
    src = _client()
    batches = [_batch(src, 3, 1, seed=3), _batch(src, 4, 2, seed=4)]
    _saved_with_store(tmp_path, src, batches)
    dst = _client()
    dst.load_checkpoint(tmp_path / "dp")
    restored = load_producer_state(tmp_path / "s.safetensors", GRPOSaveState(total_steps=2), _cfg(1, True))
    assert restored.rows_in_store and restored.dropped_groups == 0
    restore_batches(restored, dst, G)
    for before, after in zip(batches, restored.state.ready):
        assert after.meta.keys == before.meta.keys and after.meta.fields == before.meta.fields
        assert after.meta.sequence_lengths == before.meta.sequence_lengths and after.meta.tags == before.meta.tags
        old, new = read_columns(src, before.meta), read_columns(dst, after.meta)
        assert all(torch.equal(old[k], new[k]) for k in old)
        # the restored claim cursor lets the step claim its whole batch, in prompt order
        claimed = dst.claim_meta(after.meta.partition_id, CLAIM_TASK, list(after.meta.fields), 4, blocking=False)
        assert claimed.keys == before.meta.keys


def test_store_checkpoint_reconciled_with_the_resumed_run(tmp_path):
    src = _client()
    _saved_with_store(tmp_path, src, [_batch(src, 3, 0, seed=1), _batch(src, 4, 2, seed=2)])
    saved = tmp_path / "s.safetensors"
    # the rows are only in data_plane/: a resume that does not load the store is refused in one line
    with pytest.raises(CheckpointError, match="resume with checkpointing.save_data_plane=true"):
        load_producer_state(saved, GRPOSaveState(total_steps=2), _cfg(2))
    # a tighter bound drops both batches (counted); their restored partitions leave the store
    dst = _client()
    dst.load_checkpoint(tmp_path / "dp")
    tight = load_producer_state(saved, GRPOSaveState(total_steps=2), _cfg(1, True))
    assert tight.dropped_groups == 4 and tight.state.ready == []
    restore_batches(tight, dst, G)
    assert partition_for(3) not in dst.export_state() and partition_for(4) not in dst.export_state()
    # a store that does not hold the kept batches as the state file describes them is refused
    kept = load_producer_state(saved, GRPOSaveState(total_steps=2), _cfg(2, True))
    with pytest.raises(CheckpointError, match="no partition 'train_b3'"):
        restore_batches(kept, _client(), G)
    src.claim_meta(partition_for(3), CLAIM_TASK, ["input_ids"], 1, blocking=False)  # claimed before the checkpoint
    src.save_checkpoint(tmp_path / "dp_claimed")
    claimed = _client()
    claimed.load_checkpoint(tmp_path / "dp_claimed")
    with pytest.raises(CheckpointError, match="has keys claimed by 'async_claim'"):
        restore_batches(kept, claimed, G)
