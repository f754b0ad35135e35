"""The shared wire vectors: fresh on disk, and Python agrees with its own files."""

from __future__ import annotations

from pathlib import Path

from tests.vectors import check, generate

HERE = Path(generate.__file__).resolve().parent


def test_checked_in_vectors_are_fresh() -> None:
    assert (HERE / "msgpack.txt").read_text() == generate.render_msgpack(), (
        "run: python tests/vectors/generate.py"
    )
    assert (HERE / "envelope.txt").read_text() == generate.render_envelope()


def test_python_decodes_its_own_vectors(tmp_path: Path) -> None:
    for kind in ("msgpack", "envelope"):
        lines = (HERE / f"{kind}.txt").read_text().splitlines()
        path = tmp_path / kind
        path.write_text("\n".join("\t".join(line.split("\t")[:2]) for line in lines))
        assert check.check(kind, path) == []


def test_checker_notices_a_wrong_value(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    # int_1 encoded as 2; an atom sent as a plain string must not pass as an atom.
    path.write_text("int_1\t02\natom_ok\ta26f6b\n")
    problems = check.check("msgpack", path)
    assert any(p.startswith("int_1:") for p in problems)
    assert any(p.startswith("atom_ok:") for p in problems)
