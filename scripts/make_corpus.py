"""Build a large text corpus for recipe comparisons from the files already on a machine: its Python
sources, or the prose documentation its packages ship.

    python scripts/make_corpus.py OUT [--kind code|prose] [--roots DIR ...] [--min-bytes 2e8] [--max-bytes 2e7]

Collects every file of the kind under the roots (default: this Python's standard library and its
site-packages): ``code``, the ``.py`` sources; ``prose``, the ``.rst``, ``.md``, ``.txt`` and
``.pod`` documents and the readable text of ``.html`` pages (their main article, without
navigation; Sphinx's ``_sources`` copies and ``_modules`` pages left out), those that are mostly
words in lines of text (at least 70% letters and whitespace, 8% spaces, 20 characters a line on
average: no word lists or encoded blobs; licence and metadata files left out, as near-copies of
each other). Drops exact duplicates (by content hash, so no file
is both in training and validation) and empty or non-UTF-8 files, and writes the rest into OUT as
one file each, named by its hash. ``twofour train --data OUT`` then splits it by file (about 5% to
validation, by a hash of the name). ``--max-bytes`` stops collecting once the corpus is that large
(a short run needs only its own tokens: it saves the time of reading every source). Nothing is
downloaded: scripts/README.md gives the commands that fetch Debian's documentation packages for
the 110 MB prose corpus.
Prints the corpus size and fails (exit status 1) if it is smaller than ``--min-bytes``.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import re
import site
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kind:
    """What a corpus collects: the file suffixes, the text each file gives (``text``: an HTML page's
    readable text, else the file as it is) and which texts it keeps."""

    suffixes: tuple[str, ...]
    keep: Callable[[Path, str], bool]
    text: Callable[[Path, str], str] = lambda path, text: text
    #: Leave out a documentation build's copies and index pages (:func:`_generated`): not for the
    #: code kind, so that its corpus stays the one earlier runs used.
    built_docs: bool = False


#: Elements of a documentation page that are not its text: navigation, page furniture, code run
#: by the browser.
_SKIP_TAGS = {"script", "style", "nav", "header", "footer", "head"}
_SKIP_CLASSES = {"navheader", "navfooter", "sphinxsidebar", "related", "footer", "header", "headerlink", "toc",
                 "navigation", "sidebar", "breadcrumbs", "prev-next-area", "prev-next-footer"}
_BLOCKS = {"p", "div", "li", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "dt", "dd", "br", "section",
           "blockquote", "table", "ul", "ol"}
_VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "area", "base", "col", "source"}


class _PageText(html.parser.HTMLParser):
    """The readable text of an HTML documentation page: its main article where the page marks one
    (Sphinx's ``role="main"``/``itemprop="articleBody"``), else its body, without navigation."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.main: list[str] | None = None  # the marked article's text, once found
        self.body: list[str] = []
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, the main article)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _VOID:
            if tag == "br":
                self._put("\n")
            return
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        skipped = tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES) or a.get("role") == "navigation"
        main = self.main is None and (a.get("role") == "main" or a.get("itemprop") == "articleBody")
        if main:
            self.main = []
        self.stack.append((tag, skipped, main))
        if tag in _BLOCKS:
            self._put("\n")

    def handle_endtag(self, tag: str) -> None:
        while self.stack:  # pages close tags out of order now and then: pop to the matching one
            if self.stack.pop()[0] == tag:
                break
        if tag in _BLOCKS:
            self._put("\n")

    def handle_data(self, data: str) -> None:
        self._put(data)

    def _put(self, text: str) -> None:
        if any(skipped for _, skipped, _ in self.stack):
            return
        in_main = any(main for _, _, main in self.stack)
        (self.main if in_main and self.main is not None else self.body).append(text)

    def text(self) -> str:
        raw = "".join(self.main if self.main else self.body)
        lines = "\n".join(line.strip() for line in raw.splitlines())
        return re.sub(r"\n{3,}", "\n\n", lines).strip() + "\n"


def html_text(path: Path, text: str) -> str:
    """The readable text of an HTML page (:class:`_PageText`); other files as they are."""
    if path.suffix not in (".html", ".htm"):
        return text
    parser = _PageText()
    parser.feed(text)
    parser.close()
    return parser.text()


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


KINDS = {"code": Kind((".py",), lambda path, text: True),
         "prose": Kind((".rst", ".md", ".txt", ".pod", ".html", ".htm"), _is_prose, html_text, built_docs=True)}


#: Folders of a built documentation tree that repeat its pages (Sphinx's copies of each page's
#: source beside its HTML) or hold no text of their own.
_GENERATED = {"_sources", "_static", "_downloads", "_images", "_modules"}


#: Pages that repeat a documentation tree's other pages or only list them: mdBook's whole book on
#: one page, Sphinx's indexes and search page.
_GENERATED_PAGES = {"print.html", "genindex.html", "search.html", "py-modindex.html", "searchindex.js"}


def _generated(path: Path) -> bool:
    """Whether ``path`` lies in a documentation build's folder of copies (:data:`_GENERATED`) or
    is a page that repeats or lists the others (:data:`_GENERATED_PAGES`)."""
    return path.name in _GENERATED_PAGES or not _GENERATED.isdisjoint(path.parts)


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
        for path in sorted(p for p in root.rglob("*")
                           if p.suffix in kind.suffixes and not (kind.built_docs and _generated(p))):
            if size >= max_bytes:
                return files, dups, size
            try:
                data = path.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            text = kind.text(path, text)
            if not text.strip() or not kind.keep(path, text):
                continue
            data = text.encode("utf-8")
            digest = hashlib.sha1(data).hexdigest()
            if digest in seen:
                dups += 1
                continue
            seen.add(digest)
            suffix = ".txt" if path.suffix in (".html", ".htm") else path.suffix
            (out / f"{digest}{suffix}").write_bytes(data)
            files, size = files + 1, size + len(data)
    return files, dups, size


def corpus_digest(out: Path) -> str:
    """The first 16 hex digits of a SHA-256 over the corpus's file names (each its content's hash):
    two corpora with the same digest hold the same files."""
    return hashlib.sha256("\n".join(sorted(p.name for p in out.iterdir())).encode()).hexdigest()[:16]


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
    print(f"{args.out}: {files} files, {size / 1e6:.1f} MB ({dups} duplicates dropped), digest "
          f"{corpus_digest(args.out)}, from {', '.join(map(str, roots))}")
    if size < args.min_bytes:
        print(f"only {size / 1e6:.1f} MB, fewer than --min-bytes {args.min_bytes / 1e6:.0f} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
