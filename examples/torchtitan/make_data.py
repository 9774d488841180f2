"""Write a small c4_test-shaped data set (JSON lines of {"text": ...}) for torchtitan's examples.

    python examples/torchtitan/make_data.py OUT_DIR [--records 4000]

torchtitan's ``c4_test`` loader reads ``training.dataset_path`` with ``datasets.load_dataset``; its
own test file is not in its wheel. This takes the text of this Python's standard library sources
(present wherever Python is; nothing is downloaded), in records of about 2,000 characters, sorted
by file path so that every machine writes the same file.
"""

import argparse
import json
import sysconfig
from pathlib import Path


def records(n: int, size: int = 2000) -> list[str]:
    """``n`` chunks of about ``size`` characters from the standard library's ``.py`` files."""
    out: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out += [text[i:i + size] for i in range(0, len(text), size) if text[i:i + size].strip()]
        if len(out) >= n:
            return out[:n]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--records", type=int, default=4000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = records(args.records)
    with open(args.out / "data.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    print(f"{len(texts)} records -> {args.out / 'data.json'}")


if __name__ == "__main__":
    main()
