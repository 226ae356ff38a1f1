"""The ``zgraph`` command."""

from __future__ import annotations

import argparse
import sys

from zgraph import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zgraph", description="zgraph: ZeRO sharding of a whole training step")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="train a small GPT through @zgraph.distribute")
    demo.add_arguments(demo_parser)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
