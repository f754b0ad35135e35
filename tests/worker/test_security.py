"""What a client can reach in a real worker serving the SHIPPED export table: nothing else.

One worker subprocess (``python -m bridge_py.worker``, no ``--exports``) spoken to over its
real stdin/stdout framing. The tests check that nothing from the wire is ever unpickled (pickle
bytes stay bytes, unknown extension types are refused), and that every way of reaching
Python's internals (os, subprocess, builtins, importlib, eval/exec, getattr chains, dunder
attributes, private names, methods the table does not list) is refused with ``not_exported``
or ``not_found`` through each operation: create, call, call_function and get_attr.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from bridge_py.worker import envelope as pb
from bridge_py.worker.codec import PLAIN, RefValue
from bridge_py.worker.exports import ExportedClass, ExportedFunction, ExportTable, NotExported
from tests.worker.port_client import PortClient, WorkerError

pytestmark = pytest.mark.timeout(120)

# Names that would reach the interpreter's internals, as class or function names.
INTERNALS = [
    "os",
    "os.system",
    "posix.system",
    "subprocess.Popen",
    "subprocess.run",
    "builtins.eval",
    "builtins.exec",
    "builtins.open",
    "eval",
    "exec",
    "compile",
    "open",
    "getattr",
    "setattr",
    "__import__",
    "__builtins__",
    "importlib.import_module",
    "pickle.loads",
    "torch.load",
    "object",
    "type",
    "torch.distributed.TCPStore",
    "bridge_py.distributed.utils.divide",  # an exported function, by its module path
    "parallel_state.get_world_group",
    "Handle",  # classes of the package that the table does not list
    "TCPStore",
]

# Dunder and private members, and attribute chains, reached through an exported class.
CLASS_MEMBERS = [
    "StatelessProcessGroup.__init__",
    "StatelessProcessGroup.__new__",
    "StatelessProcessGroup.__class__",
    "StatelessProcessGroup.__reduce__",
    "StatelessProcessGroup.__subclasses__",
    "StatelessProcessGroup.__class__.__subclasses__",
    "StatelessProcessGroup.__post_init__",
    "StatelessProcessGroup._peer",
    "StatelessProcessGroup._write",
    "StatelessProcessGroup._dumps",
    "StatelessProcessGroup.send_obj",  # a method, not a static method
    "StatelessProcessGroup.create.__globals__",
    "StatelessProcessGroup.create.__func__",
    "MessageQueue.__new__",
    "MessageQueue._check_writer",
    "GroupCoordinator.__init__",
    "divide.__globals__",
    "divide.__code__",
    "divide.__builtins__",
    "get_world_group.__globals__",
]

# Method names on a StatelessProcessGroup ref that must not be callable.
METHODS = [
    "__reduce__",
    "__reduce_ex__",
    "__init__",
    "__class__",
    "__getattribute__",
    "__setattr__",
    "__delattr__",
    "__dict__",
    "__post_init__",
    "__globals__",
    "__subclasses__",
    "__init_subclass__",
    "_peer",
    "_write",
    "_dumps",
    "_loads",
    "_await",
    "_waiter",
    "auth_key",
    "store",  # an attribute, not a method
    "rank",
    "create",  # a static method: reached as a function only
    "send_obj.__globals__",
    "__class__.__subclasses__",
    "eval",
    "system",
]

# Attribute names on a StatelessProcessGroup ref that must not be readable.
ATTRIBUTES = [
    "__class__",
    "__dict__",
    "__module__",
    "__init__",
    "__reduce__",
    "__globals__",
    "__subclasses__",
    "__weakref__",
    "__dataclass_fields__",
    "__builtins__",
    "_waiter",
    "_auth_key",
    "_barrier_count",
    "auth_key",
    "socket",
    "send_obj",  # a method, not an attribute
    "store.__class__",
    "__class__.__init__.__globals__",
]


class Evil:
    """Unpickling this creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


@pytest.fixture(scope="module")
def shipped() -> Iterator[PortClient]:
    """A worker serving the shipped export table, shared by this module's tests."""
    client = PortClient()
    yield client
    client.close()


@pytest.fixture(scope="module")
def group(shipped: PortClient) -> RefValue:
    """A one-rank StatelessProcessGroup in the worker (a ref)."""
    ref = shipped.function("StatelessProcessGroup.create", "127.0.0.1", 0, 0, 1, store_timeout=10)
    assert ref.class_name == "StatelessProcessGroup"
    return ref


@pytest.fixture
def evil(tmp_path: Path) -> tuple[bytes, Path]:
    """The pickle of an :class:`Evil`, and the file it would create; checks it is live."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Evil(probe))).close()
    assert probe.exists()
    target = tmp_path / "pwned"
    return pickle.dumps(Evil(target)), target


def _error(worker: PortClient, op: pb.Operation, session: str = "") -> pb.Error:
    with pytest.raises(WorkerError) as info:
        worker.request(op, session)
    return info.value.error


def _refused(worker: PortClient, ops: list[pb.Operation], category: str = "not_exported") -> None:
    for op in ops:
        err = _error(worker, op)
        assert err.category == category, (op, err)
        assert err.traceback == ""  # refused before anything ran


# --- nothing from the wire is unpickled -----------------------------------------------------


def test_pickle_bytes_stay_bytes(shipped: PortClient, group: RefValue, evil) -> None:
    payload, target = evil
    value = {"pickle": payload, "nested": [payload, (payload,)], payload: "as a key"}
    assert shipped.request(pb.Ping(PLAIN.encode(value))) == value
    # As an argument of a real call: stored (pickled by the group as bytes) and read back.
    assert shipped.call(group, "send_obj", payload, 0) is None
    assert shipped.call(group, "recv_obj", 0) == payload
    assert shipped.call(group, "broadcast_obj", [payload], 0) == [payload]
    assert not target.exists()


def test_only_the_four_extension_types_decode(shipped: PortClient, evil) -> None:
    payload, target = evil
    assert len(payload) < 256
    for code in (0, 5, 6, 42, 127, -1, -128):
        # [ext8(code, payload)], written by hand: msgpack.ExtType refuses negative codes.
        data = b"\x91\xc7" + bytes([len(payload), code & 0xFF]) + payload
        err = _error(shipped, pb.Ping(data))
        assert err.category == "bad_args", (code, err)
        # -1 is msgpack's timestamp type: 104 bytes are not a timestamp either.
        assert "extension type" in err.message or "timestamp" in err.message, (code, err)
        err = _error(shipped, pb.CallFunction("divide", data))
        assert err.category == "bad_args", (code, err)
    # Pickle bytes inside the known types are not objects either.
    for code in (1, 2):  # tensor, ref: malformed payloads
        data = msgpack.packb([msgpack.ExtType(code, payload)], use_bin_type=True)
        err = _error(shipped, pb.Ping(data))
        assert err.category in ("bad_args", "not_found"), (code, err)
    tuple_of_bytes = msgpack.packb(msgpack.ExtType(4, msgpack.packb([payload])))
    assert shipped.request(pb.Ping(tuple_of_bytes)) == (payload,)
    assert not target.exists()


def test_timestamp_extension_is_refused(shipped: PortClient) -> None:
    err = _error(shipped, pb.Ping(b"\xd7\xff" + bytes(8)))  # fixext8, type -1
    assert err.category == "bad_args"


# --- nothing outside the table is reachable -------------------------------------------------


def test_create_refuses_everything_not_exported(shipped: PortClient) -> None:
    _refused(shipped, [pb.CreateInstance(name) for name in INTERNALS + CLASS_MEMBERS])
    args = PLAIN.encode(["import os"])
    _refused(shipped, [pb.CreateInstance(name, args) for name in ("eval", "exec", "compile")])


def test_call_function_refuses_everything_not_exported(shipped: PortClient) -> None:
    args = PLAIN.encode(["__import__('os').system('true')"])
    _refused(shipped, [pb.CallFunction(name, args) for name in INTERNALS + CLASS_MEMBERS])


def test_call_refuses_unexported_and_dunder_methods(shipped: PortClient, group: RefValue) -> None:
    _refused(shipped, [pb.CallMethod(group.handle, name) for name in METHODS])
    # An object of a class the table does not list (the group's store) has no methods at all.
    store = shipped.request(pb.GetAttribute(group.handle, "store"))
    assert isinstance(store, RefValue)
    names = ["get", "set", "wait", "delete_key", "__reduce__", "__init__", "__class__"]
    _refused(shipped, [pb.CallMethod(store.handle, name) for name in names])
    _refused(shipped, [pb.GetAttribute(store.handle, name) for name in ("host", "__class__")])
    assert shipped.request(pb.GetAttribute(group.handle, "rank")) == 0


def test_get_attr_refuses_unexported_and_dunder_attributes(
    shipped: PortClient, group: RefValue
) -> None:
    _refused(shipped, [pb.GetAttribute(group.handle, name) for name in ATTRIBUTES])
    assert shipped.request(pb.GetAttribute(group.handle, "world_size")) == 1


def test_unknown_released_and_foreign_handles_are_not_found(
    shipped: PortClient, group: RefValue
) -> None:
    mine = shipped.function("StatelessProcessGroup.create", "127.0.0.1", 0, 0, 1, session="a")
    others = [0, 999_999, 2**63, mine.handle]  # the last one belongs to session "a"
    for handle in others:
        for op in (
            pb.CallMethod(handle, "barrier"),
            pb.CallMethod(handle, "__reduce__"),
            pb.GetAttribute(handle, "rank"),
            pb.GetAttribute(handle, "__class__"),
            pb.CallFunction("divide", PLAIN.encode([RefValue(handle), 1])),
            pb.CreateInstance("StatelessProcessGroup", PLAIN.encode([0, 1, RefValue(handle)])),
        ):
            assert _error(shipped, op, session="b").category == "not_found", (handle, op)
    assert shipped.request(pb.ReleaseHandles([mine.handle]), session="a") == 1
    assert _error(shipped, pb.GetAttribute(mine.handle, "rank"), "a").category == "not_found"
    assert shipped.request(pb.GetAttribute(group.handle, "rank")) == 0


def test_describe_lists_no_dunder_name(shipped: PortClient) -> None:
    table = shipped.request(pb.Describe())
    names = list(table["functions"])
    for name, entry in table["classes"].items():
        names += [name, *entry["methods"], *entry["static_methods"], *entry["attributes"]]
    assert "StatelessProcessGroup" in table["classes"] and "divide" in table["functions"]
    assert [n for n in names if n.startswith("__") or ".__" in n] == []
    spg = table["classes"]["StatelessProcessGroup"]
    assert not {"_peer", "_write", "_dumps", "_loads", "_await", "auth_key"} & {
        *spg["methods"],
        *spg["attributes"],
    }


# --- the export table itself ----------------------------------------------------------------


class _Thing:
    def ok(self) -> int:
        return 1


def test_export_table_refuses_to_list_dunder_members() -> None:
    for field in ("methods", "static_methods", "attributes"):
        for name in ("__reduce__", "__init__", "__class__", "__dict__"):
            entry = ExportedClass("Thing", _Thing, "M", **{field: ("ok", name)})
            with pytest.raises(ValueError, match="dunder"):
                ExportTable.build([entry])
    # Even a table assembled without build() never hands out a dunder member.
    entry = ExportedClass("Thing", _Thing, "M", ("ok", "__reduce__"), (), ("__dict__",))
    table = ExportTable(classes={"Thing": entry})
    with pytest.raises(NotExported):
        table.method(_Thing(), "__reduce__")
    with pytest.raises(NotExported):
        table.attribute(_Thing(), "__dict__")
    assert table.method(_Thing(), "ok")() == 1


def test_export_table_refuses_dunder_function_and_class_names() -> None:
    with pytest.raises(ValueError, match="dunder"):
        ExportTable.build([], [ExportedFunction("__import__", __import__, "M")])
    with pytest.raises(ValueError, match="dunder"):
        ExportTable.build([ExportedClass("__Thing__", _Thing, "M")])


def test_export_table_runs_out_of_turn_only_exported_methods_it_names() -> None:
    # A method that skips its turn must be one the class exports: a typo or an attribute
    # named there would otherwise fail quietly (or open a way around the ordering).
    with pytest.raises(ValueError, match="unordered but not an exported method"):
        ExportTable.build([ExportedClass("Thing", _Thing, "M", ("ok",), unordered=("stop",))])
    table = ExportTable.build([ExportedClass("Thing", _Thing, "M", ("ok",), unordered=("ok",))])
    assert table.takes_turn(_Thing(), "ok") is False
    assert table.takes_turn(object(), "ok") is True  # not an exported class: in turn
