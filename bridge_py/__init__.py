"""bridge_py: vLLM's distributed primitives without vLLM, and a worker that serves them.

Layers, each a subpackage, data flowing one way:

* ``bridge_py.distributed``: the primitives themselves (``StatelessProcessGroup`` ...),
  importable on their own, with vLLM's names and signatures.
* ``bridge_py.worker``: a process that serves those objects as handle-based calls
  (export table, handle registry, value codec, dispatcher, transports).
* ``bridge_py.codegen``: writes the Elixir modules from the export table.
"""

__version__ = "0.1.0"
