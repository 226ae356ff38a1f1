"""Pipeline parallelism over ``P x D`` ranks (two pipelines of two stages, ZeRO stage 0) against eager PyTorch on
the global batch, and the gradient reductions each step issues (one per stage, whatever the micro-batch count):
the worker of ``test_pipeline_data.py``."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.distributed as dist
from dist_harness import all_gather_values, run_named
from pipeline_cases import LR, Net, _params, batches, step

import zgraph

P = 2


def train(rank: int, world: int, microbatches: int, steps: int) -> dict:
    """``steps`` steps of eager on the whole batch and of the pipelined step on this rank's pipeline's rows; the
    sizes of the all-reduces the last step issued."""
    eager_model = Net()
    model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=LR)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = zgraph.Config(backend="eager", pipeline_parallel=P, schedule="1f1b", microbatches=microbatches)
    compiled = zgraph.distribute(config)(step)
    want, got, sizes = [], [], []
    for i, batch in enumerate(batches()[:steps]):
        want.append(step(eager_model, eager_opt, *batch))
        with counted(sizes if i == steps - 1 else []):
            got.append(compiled(model, opt, *zgraph.pipeline_batch(batch, P)))
    owned = [role.name for name, gm in compiled.graphs.items() if name.endswith(".update") for role in _params(gm)]
    eager = dict(eager_model.named_parameters())
    distance = max((p - eager[n]).abs().max().item() for n, p in model.named_parameters() if n in owned)
    full = zgraph.full_state_dict(model)
    whole = max((full[k] - v).abs().max().item() for k, v in eager_model.state_dict().items())
    numel = sum(eager[n].numel() for n in owned)
    explained = next(line for line in compiled.explain().splitlines() if line.startswith("pipeline:"))
    return {"want": want, "got": got, "owned": owned, "distance": distance, "whole": whole, "sizes": sizes,
            "stage_numel": numel, "explained": explained}  # fmt: skip


@contextlib.contextmanager
def counted(sizes: list[int]) -> Iterator[None]:
    """The sizes of the ``dist.all_reduce`` calls made inside, appended to ``sizes``."""
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield
    finally:
        dist.all_reduce = real


def two_by_two(rank: int, world: int) -> list[dict]:
    return all_gather_values([train(rank, world, 2, steps=3), train(rank, world, 4, steps=1)])


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    run_named(rank, world, out_path, names, globals())
