"""GroupCoordinator's parts below ``parallel_state`` (vLLM's module path, which re-exports)."""
