"""Build a large text corpus for recipe comparisons from the files already on a machine: its Python
sources, or the prose documentation its packages ship.

    python scripts/make_corpus.py OUT [--kind code|prose] [--roots DIR ...] [--min-bytes 2e8] [--max-bytes 2e7]

Collects every file of the kind under the roots (default: this Python's standard library and its
site-packages): ``code``, the ``.py`` sources; ``prose``, the ``.rst``, ``.md`` and ``.txt``
documents that are mostly words in lines of text (at least 70% letters and whitespace, 8% spaces,
20 characters a line on average: no word lists or encoded blobs; licence and metadata files left
out, as near-copies of each other). Drops exact duplicates (by content hash, so no file is both in
training and validation) and empty or non-UTF-8 files, and writes the rest into OUT as one file
each, named by its hash. ``twofour train --data OUT`` then splits it by file (about 5% to validation, by a
hash of the name). ``--max-bytes`` stops collecting once the corpus is that large (a short run
needs only its own tokens: it saves the time of reading every source). Nothing is downloaded.
Prints the corpus size and fails (exit status 1) if it is smaller than ``--min-bytes``.
"""

from __future__ import annotations

import argparse
import hashlib
import site
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kind:
    """What a corpus collects: the file suffixes, and which decoded texts it keeps."""

    suffixes: tuple[str, ...]
    keep: Callable[[Path, str], bool]


def _is_prose(path: Path, text: str) -> bool:
    """Mostly words in lines of text (not a word list or an encoded blob), and not a licence or
    packaging metadata file."""
    if path.name.upper().startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS", "RECORD", "METADATA",
                                     "TOP_LEVEL", "ENTRY_POINTS", "REQUIRES", "SOURCES", "DEPENDENCY_LINKS")):
        return False
    lines = [line for line in text.splitlines() if line.strip()]
    words = sum(c.isalpha() or c.isspace() for c in text)
    return (words >= 0.7 * len(text) and text.count(" ") >= 0.08 * len(text)
            and sum(map(len, lines)) >= 20 * len(lines))


KINDS = {"code": Kind((".py",), lambda path, text: True), "prose": Kind((".rst", ".md", ".txt"), _is_prose)}


def default_roots() -> list[Path]:
    """The standard library and every site-packages folder of this Python."""
    roots = {Path(sysconfig.get_paths()["stdlib"]), *map(Path, site.getsitepackages())}
    return sorted(r for r in roots if r.is_dir())


def build(out: Path, roots: list[Path], max_bytes: float = float("inf"),
          kind: Kind = KINDS["code"]) -> tuple[int, int, int]:
    """Write the deduplicated files of ``kind`` into ``out``, stopping once ``max_bytes`` are
    written; returns (files written, duplicates dropped, bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    files = dups = size = 0
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in kind.suffixes):
            if size >= max_bytes:
                return files, dups, size
            try:
                data = path.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not data.strip() or not kind.keep(path, text):
                continue
            digest = hashlib.sha1(data).hexdigest()
            if digest in seen:
                dups += 1
                continue
            seen.add(digest)
            (out / f"{digest}{path.suffix}").write_bytes(data)
            files, size = files + 1, size + len(data)
    return files, dups, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("out", type=Path, help="folder to write (created; files already there are kept)")
    ap.add_argument("--kind", choices=sorted(KINDS), default="code", help="Python sources or prose documents")
    ap.add_argument("--roots", type=Path, nargs="+", default=None, help="folders to collect the files from")
    ap.add_argument("--min-bytes", type=float, default=0, help="fail if the corpus is smaller (e.g. 2e8)")
    ap.add_argument("--max-bytes", type=float, default=float("inf"), help="stop collecting at this size (e.g. 2e7)")
    args = ap.parse_args()
    roots = args.roots or default_roots()
    files, dups, size = build(args.out, roots, args.max_bytes, KINDS[args.kind])
    print(f"{args.out}: {files} files, {size / 1e6:.1f} MB ({dups} duplicates dropped) from "
          f"{', '.join(map(str, roots))}")
    if size < args.min_bytes:
        print(f"only {size / 1e6:.1f} MB, fewer than --min-bytes {args.min_bytes / 1e6:.0f} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
