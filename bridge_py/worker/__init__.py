"""The worker: serves exported Python objects as handle-based calls.

``python -m bridge_py.worker`` reads bridge.proto Requests from stdin and writes
Replies to stdout (see docs/protocol.md), or serves them over gRPC. Inside, data flows
one way:

transport (``transports/``: frames in, replies out)
-> dispatcher (``dispatcher``: ``admit`` works out what a frame is, from a call plan
   (``call_plans``) or the envelope (``envelope``), and takes its turn (``sequencer``);
   ``run`` answers it)
-> operations (``operations``) -> export table (``exports``, ``export_table``)
   + handle registry (``registry``) + argument checks (``arguments``)
-> value codec (``codec``).
"""
