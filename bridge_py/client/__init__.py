"""A Python client for a worker served over gRPC (``python -m bridge_py.worker --grpc``).

::

    from bridge_py.client import connect

    with connect("10.0.0.5:50051", token_file="/path/to/token") as worker:
        pg = worker.call_function("StatelessProcessGroup.create", "10.0.0.5", 29500, 0, 2)
        pg.broadcast_obj({"step": 1}, 0)     # a proxy: methods call through
        pg.rank                              # exported attributes read through

The token is ``token=``, else the file ``token_file=``, else ``$VLLM_BRIDGE_TOKEN``;
a worker on ``unix:PATH`` needs none. Each client opens a session of its own (the
worker issues it, bound to the token); ``session=other.session`` shares one.

Remote objects come back as :class:`RemoteObject` proxies; a proxy's handle is
released when the proxy is garbage-collected, and every handle of the client's
session when the client is closed.
"""

from bridge_py.client.connection import BridgeError, Client, connect
from bridge_py.client.proxy import ObjectHost, RemoteObject

__all__ = ["BridgeError", "Client", "ObjectHost", "RemoteObject", "connect"]
