"""Workers and the wires between them: `BatchedDataDict`, worker groups behind one API (the in-process `local`
executor and the `ray` executor, dispatching by method reference), torch.distributed collectives, data-parallel
wrapping (manual, DDP, FSDP2) and weight refit to generation workers.

Imports allowed: torch, `relayrl.utils`, `relayrl.config` (Ray only inside `ray_executor`, loaded on demand);
never models, experience, environments or algorithms. Same layer as `relayrl.data_plane`.
"""
