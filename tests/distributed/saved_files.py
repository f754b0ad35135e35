"""Hostile variants of ``torch.save`` files, for the tests of readers that load them."""

from __future__ import annotations

import io
import zipfile


def deflated(archive: bytes) -> bytes:
    """The same ``torch.save`` archive with its members compressed (torch.save never
    does; a reader that inflates them can grow a few KB into many MB)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        for member in src.infolist():
            dst.writestr(member, src.read(member), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()
