"""A vLLM inference rank receiving weights, as a process of its own (for the Elixir tests).

``python -m tests.distributed.vllm_rank VERSION PORT RANK WORLD_SIZE SRC`` runs vLLM
``VERSION``'s own StatelessProcessGroup (``vllm_release``) as rank ``RANK``: rank 0 serves
the store and broadcasts the names it expects; then every rank receives, from rank ``SRC``
(the trainer), a state dict's metadata and each tensor, as RL weight syncs do, and meets
the trainer at a barrier. It prints the tensors it received as one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from tests.distributed import vllm_release


def main(argv: list[str]) -> None:
    version, port, rank, world_size, src = argv[0], *map(int, argv[1:5])
    utils = vllm_release.install(version)
    group = utils.StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, 3600, 60)
    group.broadcast_obj({"expects": ["w", "b"]} if rank == 0 else None, src=0)
    metadata = group.broadcast_obj(None, src=src)
    received = {}
    for name, (dtype, shape) in sorted(metadata.items()):
        like = torch.empty(shape, dtype=getattr(torch, dtype))
        received[name] = group.broadcast(like, src=src).flatten().tolist()
    group.barrier()
    print(json.dumps(received), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
