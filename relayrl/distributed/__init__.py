"""Workers and the wires between them: `batched_data_dict` (`BatchedDataDict`, the legacy path's batch); worker
groups behind one API (`interfaces` the contracts, `executor` picks one from config: the in-process `local` or
`ray_executor`, both dispatching by method reference); `torch_collective` (torch.distributed collectives);
`parallelize` (data-parallel wrapping: manual, DDP, FSDP2); `refit` (weights to generation workers); `errors`.

Imports allowed: torch, `relayrl.utils`, `relayrl.config` (Ray only inside `ray_executor`, loaded on demand);
never models, experience, environments or algorithms. Same layer as `relayrl.data_plane`.
"""
