"""Files that prove themselves: the CRC-32 of every saved tensor or file, checked before the bytes
are used, so a checkpoint or export damaged in place is refused instead of trained on.

``torch.save`` writes a zip whose every entry (each tensor's storage and the pickled structure)
carries its CRC-32; :func:`zip_damage` checks them all. Files without such checksums (DCP's shards,
safetensors) get one from :func:`crc32_file`, stored beside them by their writer and compared by
:func:`damaged_files`. CRC-32 catches every burst of up to 32 flipped bits and any other damage
but one time in 4 billion, at about twice SHA-256's speed (docs/checkpoints.md times it).
"""

from __future__ import annotations

import contextlib
import re
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["crc32_file", "zip_damage", "damaged_files", "checksummed_saves"]

_BLOCK = 1 << 24


def crc32_file(path: str | Path) -> int:
    """The CRC-32 of a file's bytes (zlib's, as zip files hold them)."""
    crc = 0
    with Path(path).open("rb") as fh:
        while block := fh.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def zip_damage(path: str | Path) -> str | None:
    """Why the zip file ``path`` (a ``torch.save`` file) is damaged, in a phrase naming the first
    entry whose bytes fail their CRC-32 or the structure that can't be read; None when intact."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                with z.open(info) as fh:  # zipfile checks the CRC-32 as the entry's end is read
                    while fh.read(_BLOCK):
                        pass
    except zipfile.BadZipFile as e:
        bad = re.search(r"CRC-32 for file '([^']+)'", str(e))
        if bad:
            return f"the bytes of {bad.group(1).split('/', 1)[-1]} fail their CRC-32"
        return f"its zip structure is unreadable ({str(e)[:80]})"
    except (OSError, EOFError, ValueError, zlib.error) as e:
        return f"its zip structure is unreadable ({type(e).__name__})"
    return None


def damaged_files(folder: str | Path, crcs: Mapping[str, int], names: list[str] | None = None) -> str | None:
    """Why the files of ``folder`` named in ``crcs`` (file name to CRC-32) are not what was
    written, in a phrase naming the first missing or changed one; None when all match. ``names``:
    only these of them (a rank's share)."""
    for name in sorted(crcs) if names is None else names:
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if crc32_file(path) != crcs[name]:
            return f"the bytes of {name} fail their CRC-32"
    return None


@contextlib.contextmanager
def checksummed_saves() -> Iterator[None]:
    """``torch.save`` with the CRC-32 of every zip entry computed (torch's default, which a user
    may have turned off), so that :func:`zip_damage` can check the file it writes."""
    try:
        from torch.utils.serialization import config  # noqa: PLC0415
    except ImportError:  # an older torch always computes them
        yield
        return
    before = config.save.compute_crc32
    config.save.compute_crc32 = True
    try:
        yield
    finally:
        config.save.compute_crc32 = before
