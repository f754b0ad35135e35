"""StatelessProcessGroup: vLLM's metadata group over a TCPStore (and shared memory on one node)."""

from bridge_py.distributed.spg.group import StatelessProcessGroup, validate_rank

__all__ = ["StatelessProcessGroup", "validate_rank"]
