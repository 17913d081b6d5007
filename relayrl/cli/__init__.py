"""The `relayrl` command: argument parsing, one-line errors, and dispatch to `relayrl.algorithms` (the top layer:
it may import anything in the package; nothing imports it)."""
