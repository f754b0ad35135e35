"""Writes the ``Vllm.*`` Elixir modules from the worker's export table.

``python -m bridge_py.codegen`` regenerates ``elixir/lib/vllm/**``; ``--check`` exits
non-zero when the checked-in files differ from a fresh generation. Layers:
``model`` (the export table and Python signatures -> plain descriptions of Elixir
functions), ``typespecs`` (annotations -> typespecs), ``render`` (descriptions ->
Elixir source), ``__main__`` (files, formatting, the check).
"""
