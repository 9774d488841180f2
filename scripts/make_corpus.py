"""Build a large text corpus for recipe comparisons from the Python sources already on a machine.

    python scripts/make_corpus.py OUT [--roots DIR ...] [--min-bytes 2e8] [--max-bytes 2e7]

Collects every ``.py`` file under the roots (default: this Python's standard library and its
site-packages), drops exact duplicates (by content hash, so no file is both in training and
validation) and empty or non-UTF-8 files, and writes the rest into OUT as one file each, named
by its hash. ``twofour train --data OUT`` then splits it by file (about 5% to validation, by a
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
from pathlib import Path


def default_roots() -> list[Path]:
    """The standard library and every site-packages folder of this Python."""
    roots = {Path(sysconfig.get_paths()["stdlib"]), *map(Path, site.getsitepackages())}
    return sorted(r for r in roots if r.is_dir())


def build(out: Path, roots: list[Path], max_bytes: float = float("inf")) -> tuple[int, int, int]:
    """Write the deduplicated sources into ``out``, stopping once ``max_bytes`` are written;
    returns (files written, duplicates dropped, bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    files = dups = size = 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if size >= max_bytes:
                return files, dups, size
            try:
                data = path.read_bytes()
                data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not data.strip():
                continue
            digest = hashlib.sha1(data).hexdigest()
            if digest in seen:
                dups += 1
                continue
            seen.add(digest)
            (out / f"{digest}.py").write_bytes(data)
            files, size = files + 1, size + len(data)
    return files, dups, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder to write (created; files already there are kept)")
    ap.add_argument("--roots", type=Path, nargs="+", default=None, help="folders to collect .py files from")
    ap.add_argument("--min-bytes", type=float, default=0, help="fail if the corpus is smaller (e.g. 2e8)")
    ap.add_argument("--max-bytes", type=float, default=float("inf"), help="stop collecting at this size (e.g. 2e7)")
    args = ap.parse_args()
    roots = args.roots or default_roots()
    files, dups, size = build(args.out, roots, args.max_bytes)
    print(f"{args.out}: {files} files, {size / 1e6:.1f} MB ({dups} duplicates dropped) from "
          f"{', '.join(map(str, roots))}")
    if size < args.min_bytes:
        print(f"only {size / 1e6:.1f} MB, fewer than --min-bytes {args.min_bytes / 1e6:.0f} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
