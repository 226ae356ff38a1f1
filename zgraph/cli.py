"""The ``zgraph`` command."""

from __future__ import annotations

import argparse
import sys

from zgraph import demo


def main(argv: list[str] | None = None) -> int:
    """Run the ``zgraph`` command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="zgraph", description="zgraph: ZeRO sharding of a whole training step")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="train a small GPT through @zgraph.distribute on local ranks (ZeRO-3, 2 ranks by default)",
        description="Train a small GPT with ZeRO sharding. Starts --nproc local ranks itself; under torchrun, "
        "runs as one of torchrun's ranks.",
    )
    demo.add_arguments(demo_parser)
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            demo.run(args)
        except demo.RankFailedError as error:
            print(f"zgraph demo: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("zgraph demo: interrupted", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
