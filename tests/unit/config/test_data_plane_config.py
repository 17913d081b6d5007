"""`data_plane.<backend>` blocks (NeMo RL's nested spelling) map onto DataPlaneConfig's flat keys; a block for a
store relayrl lacks is refused in one line; `checkpointing.save_data_plane` defaults to off."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from relayrl.config import DataPlaneConfig
from relayrl.config.infra import CheckpointingConfig


def test_simple_block_sets_the_flat_keys_on_any_backend() -> None:
    cfg = DataPlaneConfig.model_validate({"simple": {"storage_capacity": 77, "num_storage_units": 3}})
    assert (cfg.backend, cfg.storage_capacity, cfg.num_storage_units) == ("memory", 77, 3)
    cfg = DataPlaneConfig.model_validate({"backend": "transfer_queue", "simple": {"num_storage_units": 4}})
    assert cfg.num_storage_units == 4 and cfg.storage_capacity == 1_000_000


def test_block_named_for_the_selected_backend_applies() -> None:
    cfg = DataPlaneConfig.model_validate({"backend": "ray", "ray": {"storage_capacity": 5, "call_timeout_s": 9.0}})
    assert (cfg.storage_capacity, cfg.call_timeout_s) == (5, 9.0)
    assert DataPlaneConfig.model_validate({"simple": None}) == DataPlaneConfig()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"mooncake_cpu": {"global_segment_size": 1}}, "data_plane.mooncake_cpu: relayrl has no mooncake_cpu store"),
        ({"backend": "memory", "ray": {"storage_capacity": 5}}, "data_plane.ray configures the ray backend"),
        ({"simple": {"storage_capacity": 5}, "storage_capacity": 6}, "contradicts data_plane.storage_capacity=6"),
        ({"simple": {"total_storage_size": 5}}, "data_plane.simple.total_storage_size: not a data plane sizing key"),
        ({"simple": [1]}, "must be a mapping"),
        ({"simple": {"storage_capacity": 0}}, "storage_capacity"),
    ],
)
def test_bad_blocks_are_refused_in_one_line(data: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match) as err:
        DataPlaneConfig.model_validate(data)
    assert len(err.value.errors()) == 1


def test_agreeing_flat_and_nested_keys_are_fine() -> None:
    cfg = DataPlaneConfig.model_validate({"storage_capacity": 8, "simple": {"storage_capacity": 8}})
    assert cfg.storage_capacity == 8


def test_save_data_plane_defaults_off() -> None:
    assert CheckpointingConfig().save_data_plane is False
    assert CheckpointingConfig(save_data_plane=True).save_data_plane is True


def test_verify_checksums_is_a_described_bool_on_by_default() -> None:
    assert DataPlaneConfig().verify_checksums is True
    assert "checksum" in (DataPlaneConfig.model_fields["verify_checksums"].description or "")
    with pytest.raises(ValueError, match="verify_checksums"):
        DataPlaneConfig.model_validate({"verify_checksums": "sometimes"})
