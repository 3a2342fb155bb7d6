"""``python -m treecompile.bench <name> [args]`` runs one benchmark and prints a markdown table."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "attention": "treecompile.bench.attention",
    "rounds": "treecompile.bench.rounds",
    "e2e": "treecompile.bench.e2e",
    "linear": "treecompile.bench.linear",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print(f"usage: python -m treecompile.bench {{{','.join(BENCHES)}}} [options]")
        return 0 if (not argv or argv[0] in ("-h", "--help")) else 2
    module = importlib.import_module(BENCHES[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
