"""The ``zgraph`` command."""

from __future__ import annotations

import argparse
import sys

from zgraph.cli import estimate as estimate_cli
from zgraph.cli import estimate_lengths
from zgraph.demos import gpt_demo as demo
from zgraph.demos.ranks import DemoRankError


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
    consolidate_parser = commands.add_parser(
        "consolidate",
        help="write a zgraph checkpoint's model as one plain state_dict file (whole fp32 tensors)",
        description="Read a checkpoint directory written by zgraph.save (any world size and stage) in this one "
        "process and torch.save the model's state_dict, whole tensors, float32 for lower-precision floats: "
        "model.load_state_dict(torch.load(OUT)) needs no zgraph.",
    )
    consolidate_parser.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (zgraph.save)")
    consolidate_parser.add_argument("out", metavar="OUT.pt", help="file to write")
    estimate_parser = commands.add_parser(
        "estimate",
        help="memory and communication per rank of a model's training step, without running it",
        description="Estimate a training step (AdamW) of a model built on the meta device: model state, peak "
        "memory and collectives per rank, for any number of ranks, without a GPU or the model's memory.",
    )
    estimate_cli.add_arguments(estimate_parser)
    estimate_lengths.add_arguments(estimate_parser)
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return _estimate(args)
    if args.command == "consolidate":
        return _consolidate(args.checkpoint, args.out)
    if args.command == "demo":
        try:
            demo.run(args)
        except DemoRankError as error:
            print(f"zgraph demo: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("zgraph demo: interrupted", file=sys.stderr)
            return 130
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from zgraph.errors import CaptureError, PassError

    try:
        print(estimate_lengths.run(args) if args.seq_lens is not None else estimate_cli.run(args))
    except (estimate_cli.EstimateInputError, CaptureError, PassError) as error:  # bad input: one line, status 1
        print("zgraph estimate: " + "; ".join(str(error).strip().split("\n")), file=sys.stderr)
        return 1
    return 0


def _consolidate(checkpoint: str, out: str) -> int:
    from zgraph.checkpoint.save_load import consolidate
    from zgraph.errors import CheckpointError

    try:
        state = consolidate(checkpoint, out)
    except (CheckpointError, OSError) as error:  # every bad input: one line, exit status 1
        print("zgraph consolidate: " + "; ".join(str(error).split("\n")), file=sys.stderr)
        return 1
    tensors = [v for v in state.values() if hasattr(v, "nbytes")]
    size = sum(t.nbytes for t in tensors)
    print(f"wrote {out}: {len(state)} entries, {len(tensors)} tensors, {size / 2**20:.2f} MiB")
    return 0
