"""zgraph's own graph-level operators.

``zgraph::grad_contribution(grad, param)`` marks, in the captured graph, every gradient autograd produces for
parameter number ``param`` on this rank, before it is accumulated into ``.grad`` or returned by
``torch.autograd.grad``. It is the identity: the captured graph computes each rank's *local* gradients. The
``reduce_scatter_grads`` pass replaces every marker by the cross-rank average (DDP's meaning), which is what
makes the distributed graph match eager PyTorch on the global batch. No marker survives the pipeline.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("zgraph::grad_contribution", mutates_args=())
def grad_contribution(grad: Tensor, param: int) -> Tensor:
    """Identity that marks a rank-local gradient contribution of parameter ``param``."""
    return grad.clone()


@grad_contribution.register_fake
def _grad_contribution_fake(grad: Tensor, param: int) -> Tensor:
    return torch.empty_like(grad)


def _grad_contribution_backward(ctx: object, grad_output: Tensor) -> tuple[Tensor, None]:
    return grad_output, None


grad_contribution.register_autograd(_grad_contribution_backward)

GRAD_CONTRIBUTION = torch.ops.zgraph.grad_contribution.default
