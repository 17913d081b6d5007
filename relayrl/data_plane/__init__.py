"""Sample-keyed data plane: bulk rollout tensors live in a store; only `KVBatchMeta` crosses the driver."""

from relayrl.data_plane.codec import Column, materialize
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta

__all__ = ["Column", "DataPlaneClient", "KVBatchMeta", "build_data_plane_client", "materialize"]
