"""What every subcommand module shares: the one-line failure (exit code 2, no traceback)."""

from __future__ import annotations

import sys

EXIT_USAGE = 2


def fail(message: str) -> int:
    print(f"relayrl: error: {message}", file=sys.stderr)
    return EXIT_USAGE
