"""Model shapes the benchmarks share (keyword arguments of `relayrl.models.tiny.build_tiny_qwen2`), so that "the 25M
model" means one model in every script. Imported by the scripts beside it (their folder is first on sys.path)."""

#: ~25M parameters: the shipped model's shape widened (hidden 512, 6 layers, 8 heads, MLP 2048).
WIDE_25M: dict[str, int] = dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=8, intermediate_size=2048)

#: ~134M parameters (hidden 1024, 8 layers, 16 heads, MLP 4096).
WIDE_134M: dict[str, int] = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=16, intermediate_size=4096)
