"""The tokenizer bundle behind ``GetTokenizer``: a zip of the model folder's tokenizer files, streamed in chunks.

A gateway that cannot load the tokenizer from ``GetModelInfo.tokenizer_path`` falls back to this stream. It
concatenates every chunk's ``data``, checks the SHA-256 (hex) that only the last chunk carries against the
whole archive, and extracts the files at the archive root.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json", "special_tokens_map.json")
CHUNK_BYTES = 1 << 20  # well under gRPC's default 4 MiB message limit

# A fixed timestamp makes the archive, and so its digest, depend on file contents only.
_ZIP_DATE = (2020, 1, 1, 0, 0, 0)


def build_tokenizer_zip(folder: Path) -> bytes:
    """Zip the tokenizer files of ``folder``; raises FileNotFoundError naming a missing required file."""
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} has no {', '.join(missing)}")
    names = [*REQUIRED_FILES, *(name for name in OPTIONAL_FILES if (folder / name).is_file())]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name in names:
            entry = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            entry.external_attr = 0o644 << 16  # unix mode rw-r--r--: extractors that apply modes can read it
            archive.writestr(entry, (folder / name).read_bytes(), compress_type=zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def tokenizer_chunks(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[common_pb2.GetTokenizerChunk]:
    """Split ``data`` into chunks; the last one carries the archive's SHA-256 hex digest."""
    digest = hashlib.sha256(data).hexdigest()
    starts = range(0, len(data), chunk_bytes)
    last = len(starts) - 1
    for i, start in enumerate(starts):
        piece = data[start : start + chunk_bytes]
        yield common_pb2.GetTokenizerChunk(data=piece, sha256=digest if i == last else "")
