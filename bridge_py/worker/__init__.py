"""The worker: serves exported Python objects as handle-based calls.

``python -m bridge_py.worker`` reads bridge.proto Requests from stdin and writes
Replies to stdout (see docs/protocol.md). Inside, data flows one way:

transport (``transports/``) -> envelope (``envelope``) -> dispatcher (``dispatcher``)
-> export table (``exports``, ``export_table``) + handle registry (``registry``)
-> value codec (``codec``).
"""
