"""Sample-keyed data plane: bulk rollout tensors live in a store; only `KVBatchMeta` crosses the driver.

What lives here (one copy of each mechanism):

- `interfaces` the contract (`DataPlaneClient`, `KVBatchMeta`, the strict errors, put argument checks);
  `codec` the wire layout of one field (`Column`, `FieldSpec`, `materialize`); `meta_wire` the small pickle
  of `KVBatchMeta`; `schema` field names and `extra_info` keys shared with the trainers.
- `ledger` the bookkeeping every backend runs (partitions, schemas, live keys, written fields, tags, capacity,
  task cursors); `memory` the in-process store (`ColumnarStore` = the ledger + packed tensor segments).
- `proxy` the one client shape that forwards ledger calls through a transport (`MemoryDataPlaneClient` uses
  a direct call); `remote` the Ray transport both Ray-hosted backends share (the `LedgerHost` actor body and
  `RemoteClient`); `ray_store` the `ray` backend (a `ColumnarStore` in a named actor); `tq_adapter` the
  `transfer_queue` backend (bulk data in TransferQueue, bookkeeping in a hosted `Ledger`).
- `recorder` the flight recorder's Parquet files (one step's columns, `RUN_DIR/rollouts/step_NNNNNN.parquet`);
  `metrics` the `data_plane/*` counters wrapper (`latency` its mergeable percentile histograms); `checksum` the
  per-row checksums put records and get verifies; `factory` config -> client; `column_io`, `preshard`, `worker`
  the helpers trainers and workers use.

Imports: this package may import only `relayrl.distributed`, `relayrl.utils`, `relayrl.config` and itself, never
algorithms, models, experience or environments. Ray is imported only by `remote`, `ray_store` and `tq_adapter`
(the Ray transport and its two backends), `transferqueue` only by `tq_adapter`; `factory` loads those modules
lazily, so neither package is imported unless its backend is selected.
"""

from relayrl.data_plane.codec import Column, materialize
from relayrl.data_plane.factory import build_data_plane_client
from relayrl.data_plane.interfaces import DataPlaneClient, KVBatchMeta

__all__ = ["Column", "DataPlaneClient", "KVBatchMeta", "build_data_plane_client", "materialize"]
