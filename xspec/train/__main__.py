"""``python -m xspec.train <command> [args]``: one module per command, imported when chosen.

calibrate   fit a draft's confidence temperatures (xspec/train/calibrate.py)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"calibrate": "xspec.train.calibrate"}  # name -> module with main(argv) -> int


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m xspec.train {{{','.join(COMMANDS)}}} [args]", file=sys.stderr)
        return 2
    return int(importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
