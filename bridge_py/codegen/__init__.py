"""Writes the ``Vllm.*`` Elixir modules from the worker's export table, and both codecs'
field tables and error categories from the wire schema in ``proto/`` (``schema``).

``python -m bridge_py.codegen`` regenerates ``elixir/lib/vllm/**``,
``bridge_py/worker/schema.py`` and ``elixir/lib/vllm_bridge/proto/schema.ex``;
``--check`` exits non-zero when the checked-in files differ from a fresh generation.
Layers of the ``Vllm.*`` modules:
``model`` (plain descriptions of Elixir modules and functions), ``typespecs``
(annotations -> typespecs), ``docstrings`` (the Python docstrings' reST-ish dialect ->
ExDoc Markdown), ``references`` (Python names in docstrings -> the Elixir modules and
functions generated for them), ``build`` (the export table and Python signatures ->
the descriptions, with their docs), ``render``
(descriptions -> Elixir source), ``__main__`` (files, formatting, the check).
``python -m bridge_py.codegen.audit`` (``audit``) reports the generated docs that
still mention implementation details, by Python docstring line.

Docstrings say what a function does and promises; how it does it is for comments
and docs/architecture.md. The one convention for notes that must stay in a
docstring: a paragraph that begins with ``Implementation:`` (with any more indented
lines after it) is left out of the Elixir docs.
"""
