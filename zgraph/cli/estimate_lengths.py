"""``zgraph estimate --seq-lens 128,256,512``: the step traced once with the sequence length a size symbol
(``zgraph.mark_dynamic``); the peak and activations per rank at each length, and both as formulas in the symbol
(``zgraph.inspect.estimate.estimate_sizes``: the passes run once, liveness is evaluated at each length)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from zgraph.binding.dynamic import mark_dynamic
from zgraph.cli.estimate import (
    Estimate,
    EstimateInputError,
    Setting,
    _cost_model,
    _gc_paused,
    _meta_call,
    gib,
    setting_from_args,
)
from zgraph.inspect.estimate import estimate_sizes, prepare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seq-lens",
        default=None,
        help="comma-separated sequence lengths, e.g. 128,256,512: one trace with the length a size symbol, the peak "
        "and activations per rank at each, and their formulas in it",
    )


def run(args: argparse.Namespace) -> str:
    """The command's output for ``args`` with ``--seq-lens``; raises ``EstimateInputError`` on bad input."""
    setting = setting_from_args(args)
    lengths = _seq_lens(args.seq_lens, setting.sequence_parallel)
    found = run_seq_lens(setting, args.micro_batch, lengths)
    rows = [{"seq": n, **e.to_json()} for n, e in zip(lengths, found)]
    return json.dumps(rows, indent=2) if args.json else seq_lens_table(setting, args.micro_batch, lengths, found)


def run_seq_lens(setting: Setting, micro_batch: int, lengths: list[int]) -> list[Estimate]:
    """Estimates at each of ``lengths`` from one trace with the sequence length a size symbol (the model's position
    table as long as the longest)."""
    longest = replace(setting, seq=max(lengths))
    call = _meta_call(longest, micro_batch)
    mark_dynamic(call.args[2], 1)  # the sequence dim of the tokens (also the targets: the same tensor)
    per_rank = setting.sequence_parallel or 1
    with _gc_paused():
        config = setting.config()
        rpn = setting.ranks_per_node
        prepared = prepare(call, config, setting.world, _cost_model(setting), setting.device, ranks_per_node=rpn)
        at = [{("idx", 1): n // per_rank} for n in lengths]
        return estimate_sizes(prepared, prepared.config or config, at, copy=False)


def seq_lens_table(setting: Setting, micro_batch: int, lengths: list[int], estimates: list[Estimate]) -> str:
    """The estimates over sequence lengths as a table, with the formulas (at the longest)."""
    symbol = ", ".join(estimates[-1].size_symbols) or "none"
    per_rank = " per rank (the sequence / --sequence-parallel)" if setting.sequence_parallel else ""
    rows = [
        f"zgraph estimate: {setting.model}, {setting.world} rank(s), {setting.describe()}, micro-batch {micro_batch}, "
        f"one trace with the sequence length the symbol {symbol}{per_rank}",
        f"  {'sequence':>10}  {'peak per rank':>14}  {'activations':>14}",
    ]
    for n, e in zip(lengths, estimates):
        rows.append(f"  {n:>10}  {gib(e.peak_bytes):>14}  {gib(e.activation_bytes):>14}")
    last = estimates[-1]
    rows.append(f"  peak bytes (around sequence {lengths[-1]}): {last.peak_formula}")
    rows.append(f"  activation bytes: {last.activation_formula}")
    return "\n".join(rows)


def _seq_lens(text: str, sequence_parallel: int | None) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as error:
        raise EstimateInputError(f"--seq-lens takes comma-separated integers, got {text!r}") from error
    per_rank = sequence_parallel or 1
    bad = [n for n in lengths if n % per_rank or n // per_rank < 2]
    if not lengths or bad:
        raise EstimateInputError(
            f"--seq-lens {text!r}: every length must give each rank at least 2 positions (a size of 1 is not "
            f"symbolic) and divide by --sequence-parallel ({per_rank}); not {bad}"
        )
    return lengths
