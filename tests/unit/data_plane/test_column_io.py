"""Column helpers: first write from a rollout batch, per-token write-backs stored unpadded, padded reads."""

from __future__ import annotations

import pytest
import torch

from relayrl.data_plane.codec import Column
from relayrl.data_plane.column_io import first_write, pack_fields, read_columns, write_columns
from relayrl.data_plane.memory import ColumnarStore, MemoryDataPlaneClient
from relayrl.data_plane.schema import DP_TRAIN_FIELDS, GLOBAL_FORWARD_PAD_SEQLEN, TRAIN_CONSUMER_TASKS, sample_key
from relayrl.distributed.batched_data_dict import BatchedDataDict


@pytest.fixture
def client() -> MemoryDataPlaneClient:
    c = MemoryDataPlaneClient(ColumnarStore(1000))
    c.register_partition("train", [*DP_TRAIN_FIELDS, "total_reward", "pixel_values"], 4, list(TRAIN_CONSUMER_TASKS))
    return c


def _rollout(n: int = 4, width: int = 8) -> BatchedDataDict:
    lens = torch.tensor([3, 5, 7, 8])[:n]
    ids = torch.arange(n * width).view(n, width)
    ids[torch.arange(width) >= lens.unsqueeze(1)] = -1  # padding that must never reach the store
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lens,
        token_mask=torch.arange(width) < lens.unsqueeze(1),
        generation_logprobs=torch.full((n, width), -0.5, dtype=torch.bfloat16),
        sample_mask=torch.ones(n),
        total_reward=torch.tensor([1.0, 0.0, 1.0, 0.5])[:n],
        pixel_values=torch.randn(n, 3, 4, 4),
    )


def test_first_write_mints_meta_and_stores_unpadded(client: MemoryDataPlaneClient) -> None:
    batch = _rollout()
    keys = [sample_key(u, g) for u in ("u0", "u1") for g in range(2)]
    assert keys == ["u0_g0", "u0_g1", "u1_g0", "u1_g1"]
    meta = first_write(batch, keys=keys, client=client, partition_id="train", extra_info={"step": 1}, pad_to_multiple=4)
    assert meta.keys == keys and meta.sequence_lengths == [3, 5, 7, 8] and meta.task_name == "train"
    assert meta.extra_info == {"step": 1, "pad_to_multiple": 4} and set(meta.fields or []) == set(batch)
    stored = client.get_samples(keys, "train", ["input_ids", "pixel_values"])
    assert stored["input_ids"].values.numel() == 23 and not (stored["input_ids"].values == -1).any()
    assert torch.equal(stored["pixel_values"].values, batch["pixel_values"])
    back = read_columns(
        client, meta, ["input_ids", "generation_logprobs", "token_mask"], pad_value_dict={"input_ids": -1}
    )
    assert torch.equal(back["input_ids"], batch["input_ids"]) and torch.equal(back["token_mask"], batch["token_mask"])
    assert back["generation_logprobs"].dtype == torch.bfloat16 and "sample_mask" not in back


def test_first_write_rejects_bad_batches(client: MemoryDataPlaneClient) -> None:
    with pytest.raises(ValueError, match="must match batch size"):
        first_write(_rollout(), keys=["a", "b"], client=client, partition_id="train")
    bad = _rollout()
    bad["message_log"] = [[{"role": "user"}]] * 4
    with pytest.raises(TypeError, match="message_log"):
        first_write(bad, keys=list("abcd"), client=client, partition_id="train")
    with pytest.raises(ValueError, match="input_lengths"):
        first_write({"input_ids": torch.zeros(2, 3)}, keys=["a", "b"], client=client, partition_id="train")


def test_write_columns_strips_any_padding_and_reads_at_global_width(client: MemoryDataPlaneClient) -> None:
    meta = first_write(_rollout(), keys=list("abcd"), client=client, partition_id="train")
    shard = meta.subset([3, 1])
    shard.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = 12
    prev = torch.arange(2 * 16, dtype=torch.float32).view(2, 16)  # wider than any row: forward + SP pad
    write_columns(client, shard, {"prev_logprobs": prev, "advantages": torch.full((2, 10), 0.25)})
    stored = client.get_samples(["d", "b"], "train", ["prev_logprobs"])["prev_logprobs"]
    assert stored.lengths is not None and stored.lengths.tolist() == [8, 5]
    got = read_columns(client, shard, ["prev_logprobs", "advantages", "input_lengths"])
    assert got["prev_logprobs"].shape == (2, 12)
    assert torch.equal(got["prev_logprobs"][0, :8], prev[0, :8]) and not got["prev_logprobs"][0, 8:].any()
    assert got["advantages"][1].tolist() == [0.25] * 5 + [0.0] * 7
    assert got["input_lengths"].tolist() == [8, 5]


def test_pack_fields_requires_lengths_for_per_token_fields() -> None:
    with pytest.raises(ValueError, match="sequence lengths"):
        pack_fields({"advantages": torch.zeros(2, 4)}, None)
    cols = pack_fields({"advantages": torch.zeros(2, 4), "extra_2d": torch.zeros(2, 4)}, [3, 1])
    assert cols["advantages"].is_jagged and not cols["extra_2d"].is_jagged
    assert isinstance(cols["extra_2d"], Column) and cols["extra_2d"].values.shape == (2, 4)
