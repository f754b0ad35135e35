"""torch.distributed names that moved between releases.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` (with a warning
on every call) in favour of ``all_gather_single``/``reduce_scatter_single``; older releases
have only the former. These helpers call whichever ``module`` offers, preferring the new
names, so that a replacement transport (a communicator's ``dist_module``) may offer either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_into", "reduce_scatter_into"]


def all_gather_into(
    output: torch.Tensor, input_: torch.Tensor, group: Any, module: Any = dist
) -> None:
    """Gather every rank's ``input_`` into ``output`` (rank-major), on ``group``."""
    fn = getattr(module, "all_gather_single", None) or module.all_gather_into_tensor
    fn(output, input_, group=group)


def reduce_scatter_into(
    output: torch.Tensor, input_: torch.Tensor, group: Any, module: Any = dist
) -> None:
    """Sum ``input_`` over ``group`` and keep this rank's rank-major slice in ``output``."""
    fn = getattr(module, "reduce_scatter_single", None) or module.reduce_scatter_tensor
    fn(output, input_, group=group)
