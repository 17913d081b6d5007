"""relayrl: RL post-training of language models with a sample-keyed data plane.

Kept import-light on purpose: `relayrl --help` and config validation must not pay for torch.
"""

__version__ = "0.1.0"
