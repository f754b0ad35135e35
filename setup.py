"""What pyproject.toml cannot say: the wire schema ships inside the package.

The schema lives at the top of the repository, in ``proto/``; a wheel carries every
file of it as ``bridge_py/proto/``, for clients in other languages. Everything else is
in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SCHEMA = Path(__file__).resolve().parent / "proto"


class BuildWithSchema(build_py):
    """``build_py`` that also copies ``proto/*`` to ``bridge_py/proto/`` in the build."""

    def _schema(self) -> list[tuple[Path, Path]]:
        target = Path(self.build_lib, "bridge_py", "proto")
        return [(path, target / path.name) for path in sorted(SCHEMA.iterdir()) if path.is_file()]

    def run(self) -> None:
        super().run()
        for source, target in self._schema():
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *(str(t) for _, t in self._schema())]


setup(cmdclass={"build_py": BuildWithSchema})
