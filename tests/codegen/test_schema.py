"""One source for the wire schema: proto/ -> the field tables of both codecs.

The .proto and the category list are edited in a copy of the checkout (never the real
one): a change that is not generated fails ``--check``, generating it gives tables that
say what the .proto says, and the parser reads the .proto as protoc does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bridge_py.codegen import schema
from bridge_py.codegen.__main__ import main
from bridge_py.worker import envelope as pb
from bridge_py.worker import schema as generated

ROOT = Path(__file__).resolve().parents[2]


def _add_to_error(checkout: Path, line: str) -> None:
    proto = checkout / "proto" / "bridge.proto"
    text = proto.read_text()
    anchor = "  bytes details = 5;"
    assert anchor in text
    proto.write_text(text.replace(anchor, f"{anchor}\n  {line}"))


def test_a_field_added_to_the_proto_and_not_generated_fails_the_check(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = ["--root", str(checkout)]
    assert main(["--check", *root]) == 0
    _add_to_error(checkout, "string hint = 6;")
    assert main(["--check", *root]) == 1
    err = capsys.readouterr().err
    assert f"out of date: {schema.PYTHON_PATH}" in err
    assert f"out of date: {schema.ELIXIR_PATH}" in err
    # Generating it puts the field in both tables.
    assert main(root) == 0
    assert '(6, "hint", STRING),' in (checkout / schema.PYTHON_PATH).read_text()
    assert "{6, :hint, :string}" in (checkout / schema.ELIXIR_PATH).read_text()
    assert main(["--check", *root]) == 0
    # The real schema is untouched, and still agrees with the checked-in tables.
    assert "hint" not in (ROOT / "proto" / "bridge.proto").read_text()
    assert main(["--check"]) == 0


def test_a_category_added_and_not_generated_fails_the_check(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = ["--root", str(checkout)]
    categories = checkout / "proto" / "error_categories.txt"
    categories.write_text(categories.read_text() + "cancelled  both  the caller gave up\n")
    assert main(["--check", *root]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(root) == 0
    python = (checkout / schema.PYTHON_PATH).read_text()
    assert python.count('"cancelled",') == 2  # the Literal type and the tuple
    assert ":cancelled" in (checkout / schema.ELIXIR_PATH).read_text()


@pytest.mark.parametrize(
    "line",
    [
        "int32 code = 6;",
        "repeated string notes = 6;",
        "map<string, bytes> extra = 6;",
        "Missing missing = 6;",
        "string again = 5;",
    ],
)
def test_what_the_codecs_cannot_write_fails_generation(
    checkout: Path, capsys: pytest.CaptureFixture[str], line: str
) -> None:
    _add_to_error(checkout, line)
    assert main(["--check", "--root", str(checkout)]) == 1
    assert capsys.readouterr().err.startswith("codegen: Error")


@pytest.mark.parametrize(
    "text", ["protocol worker\n", "busy sometimes the worker is busy\n", "a w x\na w x\n"]
)
def test_a_malformed_category_list_is_refused(text: str) -> None:
    with pytest.raises(schema.SchemaError):
        schema.parse_categories(text.replace(" w ", " worker "))


def test_the_parser_reads_the_proto_as_protoc_does(tmp_path: Path) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    out = tmp_path / "bridge.desc"
    proto = ROOT / "proto" / "bridge.proto"
    args = ["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", str(proto)]
    assert protoc.main(args) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    kinds = {
        descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: "uint64",
        descriptor_pb2.FieldDescriptorProto.TYPE_STRING: "string",
        descriptor_pb2.FieldDescriptorProto.TYPE_BYTES: "bytes",
    }
    expected = []
    for message in files.file[0].message_type:
        fields = []
        for f in message.field:
            repeated = f.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
            kind = f.type_name.rsplit(".", 1)[-1] if f.type_name else kinds[f.type]
            oneof = message.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
            fields.append(
                schema.Field(f.number, f.name, "packed_uint64" if repeated else kind, oneof)
            )
        expected.append(schema.Message(message.name, tuple(sorted(fields, key=lambda f: f.number))))
    assert schema.parse_proto(proto.read_text()) == tuple(expected)


def test_the_generated_tables_are_the_codecs_tables() -> None:
    assert pb.Error.FIELDS is generated.FIELDS["Error"]
    assert pb.field_key("Request", "ping") == 0x8A
    assert pb.field_key("Reply", "error") == 0x1A
    assert pb.op_name(pb.CallFunction) == "call_function"
    sent = [c.name for c in schema.read(ROOT / "proto").categories if c.from_worker]
    assert tuple(sent) == generated.CATEGORIES


def test_a_key_read_as_a_literal_and_renumbered_fails_at_import() -> None:
    pb.check_keys("test", ((0x08, "Request", "id"), (0x5A, "Request", "call")))
    with pytest.raises(RuntimeError, match=r"Request.session is 0x12, not 0x1a"):
        pb.check_keys("test", ((0x1A, "Request", "session"),))


def test_a_generated_field_without_an_attribute_fails_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pb.Output, "FIELDS", (*pb.Output.FIELDS, (3, "hint", generated.STRING)))
    with pytest.raises(RuntimeError, match=r"envelope.Output has fields"):
        pb._check_classes()
    monkeypatch.setattr(pb.Output, "FIELDS", (*pb.Output.FIELDS[:1], (2, "dropped", "Output")))
    with pytest.raises(RuntimeError, match=r"does not write Output"):
        pb._check_classes()


def test_the_protocol_doc_lists_the_categories_a_worker_sends() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    section = doc.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    listed = tuple(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert listed == generated.CATEGORIES


def test_the_command_line_check_fails_on_a_field_not_generated(checkout: Path) -> None:
    _add_to_error(checkout, "string hint = 6;")
    done = subprocess.run(
        [sys.executable, "-m", "bridge_py.codegen", "--check", "--root", str(checkout)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert f"out of date: {schema.PYTHON_PATH}" in done.stderr
