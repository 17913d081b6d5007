"""The `relayrl` command: `main` (argument parsing and dispatch to `relayrl.algorithms`), `common` (the one-line
error), and the subcommands that need more than a dispatch: `export`, `replay`, `diff`, `inspect_run`. The top
layer: it may import anything in the package; nothing imports it."""
