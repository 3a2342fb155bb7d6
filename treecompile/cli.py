"""The ``treecompile`` console script."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from treecompile import __version__

    parser = argparse.ArgumentParser(
        prog="treecompile",
        description="Draft-tree speculative decoding for Hugging Face models (torch.compile backend 'treespec').",
    )
    parser.add_argument("--version", action="version", version=f"treecompile {__version__}")
    parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
