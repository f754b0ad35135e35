"""torch.distributed names that moved between releases.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` (with a warning
on every call) in favour of ``all_gather_single``/``reduce_scatter_single``; older releases
have only the former. These helpers call whichever ``module`` offers, preferring the new
names, so that a replacement transport (a communicator's ``dist_module``) may offer either. With
``async_op=True`` they return the ``Work`` to wait for (``groups.work.finish``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import Work

__all__ = ["all_gather_into", "reduce_scatter_into"]


def all_gather_into(
    output: torch.Tensor, input_: torch.Tensor, group: Any, module: Any = dist, **kw: bool
) -> Work | None:
    """Gather every rank's ``input_`` into ``output`` (rank-major), on ``group``."""
    return _run(module, "all_gather_single", "all_gather_into_tensor", output, input_, group, kw)


def reduce_scatter_into(
    output: torch.Tensor, input_: torch.Tensor, group: Any, module: Any = dist, **kw: bool
) -> Work | None:
    """Sum ``input_`` over ``group`` and keep this rank's rank-major slice in ``output``."""
    return _run(module, "reduce_scatter_single", "reduce_scatter_tensor", output, input_, group, kw)


def _run(
    module: Any, new: str, old: str, output: torch.Tensor, input_: torch.Tensor, group: Any, kw: Any
) -> Work | None:
    """``module``'s function ``new`` (else its ``old`` one) on the arguments (``kw``: the
    options of both, ``async_op``)."""
    fn = getattr(module, new, None) or getattr(module, old)
    return cast("Work | None", fn(output, input_, group=group, **kw))
