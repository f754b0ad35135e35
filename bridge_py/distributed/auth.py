"""Authenticated payloads: an HMAC-SHA256 tag that is checked before anything is unpickled.

StatelessProcessGroup and MessageQueue pickle objects between ranks, and unpickling runs code
chosen by whoever wrote the bytes. Anyone who can reach the TCPStore (it has no
authentication of its own) or write to a queue could therefore run code in every rank. With a
shared secret key, every value becomes::

    MAGIC (4 bytes, b"VBA1") || TAG (32 bytes) || PAYLOAD (the pickle)

    TAG = HMAC-SHA256(key, LABEL || u32be(len(context)) || context || PAYLOAD)

where ``LABEL`` is ``b"vllm_bridge.auth.v1\\x00"`` and ``context`` names where the value
belongs: the store key it was written under (``spg/p2p/<src>/<dst>/<seq>``, which names the
sender and the sequence number), or the queue and message number. A value copied to another
key, another queue or another position no longer matches its tag. The tag is compared with
:func:`hmac.compare_digest` (constant time) and the payload is only handed on if it matches,
so a forged value never reaches ``pickle.loads``.

The key is given explicitly (``auth_key=``) or taken from the environment variable
``VLLM_BRIDGE_AUTH_KEY`` (UTF-8; an empty value counts as unset). Without a key values are
plain pickles, as in vLLM; a receiver without a key refuses tagged values with a clear error
instead of unpickling garbage, and a receiver with a key refuses untagged ones.

The environment is the operator's and wins over the wire (:func:`resolve_key`, which every
place that takes a key goes through): a worker's callers reach ``auth_key=`` parameters, so
when ``VLLM_BRIDGE_AUTH_KEY`` is set an explicit key that differs from it is refused (a caller
could otherwise join a store it serves with a key it chose, and have the worker unpickle what
it signed), and with ``VLLM_BRIDGE_REQUIRE_AUTH_KEY=1`` a group or queue without any key is
refused. Both are read at each resolution, so they apply to everything made after they are set.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import struct
from typing import Any

from bridge_py.distributed.errors import AuthenticationError, ObjectLoadError

__all__ = [
    "ENV_VAR",
    "MAGIC",
    "REQUIRE_ENV_VAR",
    "TAG_BYTES",
    "AuthenticationError",
    "is_tagged",
    "key_required",
    "load_failure",
    "load_object",
    "open_object",
    "open_payload",
    "refuse_tagged",
    "resolve_key",
    "seal_object",
    "seal_payload",
    "sign",
    "switched_on",
    "verify",
]

ENV_VAR = "VLLM_BRIDGE_AUTH_KEY"
REQUIRE_ENV_VAR = "VLLM_BRIDGE_REQUIRE_AUTH_KEY"
_OFF = ("", "0", "false", "no", "off")
MAGIC = b"VBA1"
TAG_BYTES = hashlib.sha256().digest_size
_LABEL = b"vllm_bridge.auth.v1\x00"
_HEADER_BYTES = len(MAGIC) + TAG_BYTES

AuthKey = bytes | bytearray | str


def key_required() -> bool:
    """Whether the operator refuses groups and queues without a key (read now).

    ``$VLLM_BRIDGE_REQUIRE_AUTH_KEY`` set to anything but empty, ``0``, ``false``, ``no`` or
    ``off`` (any case): a misspelt value of a security switch errs on the safe side.
    """
    return switched_on(REQUIRE_ENV_VAR)


def switched_on(name: str) -> bool:
    """Whether the operator's switch ``$name`` is on (read now): set to anything but empty,
    ``0``, ``false``, ``no`` or ``off`` (any case), so that a misspelt value of a security
    switch errs on the side of what the operator asked for."""
    return os.environ.get(name, "").strip().lower() not in _OFF


def resolve_key(key: AuthKey | None, *, param: str = "auth_key") -> bytes | None:
    """The key to use: ``key`` itself (a ``str`` is UTF-8 encoded), else ``$VLLM_BRIDGE_AUTH_KEY``.

    The operator's policy, read from the environment now, comes first:

    * with ``$VLLM_BRIDGE_AUTH_KEY`` set, an explicit ``key`` must equal it (compared in
      constant time): another key raises :class:`AuthenticationError`;
    * with :func:`key_required` and neither an explicit key nor the environment variable,
      :class:`AuthenticationError` too.

    Messages name ``param`` (the parameter the key came in) and the environment variables,
    never the keys. Otherwise returns None (no authentication) when neither is set. Raises
    ValueError for an empty explicit key (almost certainly a configuration mistake) and
    TypeError for other types.
    """
    env = os.environ.get(ENV_VAR, "")
    if key is None:
        if env:
            return env.encode()
        if key_required():
            raise AuthenticationError(
                f"refused to run without an auth key: {REQUIRE_ENV_VAR} is set, and neither "
                f"{param}= nor {ENV_VAR} gives a key"
            )
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"{param} must be bytes or str, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{param} must not be empty (pass None for no authentication)")
    if env and not hmac.compare_digest(bytes(key), env.encode()):
        raise AuthenticationError(
            f"refused {param}: it differs from the operator's key in {ENV_VAR}, which "
            f"takes precedence (pass that same key, or None to use it)"
        )
    return bytes(key)


def _tag(key: bytes, context: str, payload: bytes | bytearray | memoryview) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    encoded = context.encode()
    mac.update(_LABEL)
    mac.update(struct.pack(">I", len(encoded)))
    mac.update(encoded)
    mac.update(payload)
    return mac.digest()


def sign(key: bytes, context: str, payload: bytes) -> bytes:
    """``MAGIC || tag || payload``: ``payload`` authenticated for ``context`` under ``key``."""
    return MAGIC + _tag(key, context, payload) + payload


def is_tagged(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` starts like a value from :func:`sign` (pickles never start with MAGIC)."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def verify(key: bytes, context: str, data: bytes | bytearray | memoryview, what: str) -> memoryview:
    """The payload of ``data`` if its tag is right for ``key`` and ``context``.

    ``what`` describes the value for the error message (for example "key 'p2p/1/0/3'
    from rank 1"). Raises :class:`AuthenticationError` when the tag is missing or does
    not match; nothing of the payload is interpreted before that.
    """
    view = memoryview(data)
    if len(view) < _HEADER_BYTES or not is_tagged(view):
        raise AuthenticationError(
            f"refused {what}: it is not authenticated (no {MAGIC!r} tag), but an auth key is "
            f"set: the sender has no key, or someone else wrote it"
        )
    tag = bytes(view[len(MAGIC) : _HEADER_BYTES])
    payload = view[_HEADER_BYTES:]
    if not hmac.compare_digest(tag, _tag(key, context, payload)):
        raise AuthenticationError(
            f"refused {what}: its HMAC does not match (a different auth key, a tampered "
            f"value, or a value replayed from another key or position)"
        )
    return payload


def refuse_tagged(data: bytes | bytearray | memoryview, what: str) -> None:
    """Raise :class:`AuthenticationError` if ``data`` is tagged: we have no key to check it."""
    if is_tagged(data):
        raise AuthenticationError(
            f"refused {what}: it is authenticated but this side has no auth key "
            f"(pass auth_key= or set {ENV_VAR})"
        )


def seal_payload(key: bytes | None, context: str, payload: bytes) -> bytes:
    """What to store or send: ``sign(key, context, payload)``, or ``payload`` without a key."""
    return payload if key is None else sign(key, context, payload)


def seal_object(key: bytes | None, context: str, obj: Any) -> bytes:
    """``obj`` pickled (highest protocol) and sealed for ``context`` (:func:`seal_payload`)."""
    return seal_payload(key, context, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def open_object(
    key: bytes | None, context: str, data: bytes | bytearray | memoryview, what: str
) -> Any:
    """The object :func:`seal_object` sealed in ``data``, unpickled only once its tag is
    right for ``context`` (with a key); AuthenticationError naming ``what`` otherwise."""
    return load_object(open_payload(key, context, data, what), what)


def load_object(payload: bytes | bytearray | memoryview, what: str) -> Any:
    """``payload`` unpickled; ObjectLoadError naming ``what`` (the cause chained) when it
    does not unpickle, whatever pickle or the object's class raised."""
    try:
        return pickle.loads(payload)
    except Exception as exc:
        raise load_failure(what, exc) from exc


def load_failure(what: str, exc: Exception) -> ObjectLoadError:
    """The error of ``what`` that did not unpickle, having raised ``exc``."""
    return ObjectLoadError(f"{what} does not unpickle: {type(exc).__name__}: {exc}")


def open_payload(
    key: bytes | None, context: str, data: bytes | bytearray | memoryview, what: str
) -> bytes | bytearray | memoryview:
    """The inverse of :func:`seal_payload`: the checked payload, safe to unpickle if keyed.

    With a key, :func:`verify`; without one, ``data`` itself unless it is tagged (a sender
    with a key, which this side cannot check: refused rather than unpickled as garbage).
    """
    if key is not None:
        return verify(key, context, data, what)
    refuse_tagged(data, what)
    return data
