"""The lab stays outside the product: ``twofour bench`` is short, and the scripts of benchmarks/ and
scripts/ use twofour's public names only, share one set of timers and are each named in their
README with the question they answer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])
COMMON = ROOT / "benchmarks" / "common.py"


def private_uses(source: str) -> list[str]:
    """Where ``source`` reaches a twofour name that starts with an underscore: imported
    (``from twofour.x import _y``, ``import twofour._x``) or as an attribute of a name bound to
    twofour (``ck._kernel``, ``twofour.fp8._quantize``); dunders such as ``__version__`` are public."""
    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    bound, found = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "twofour":
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"line {node.lineno}: from {node.module} import {p}" for p in parts if private(p)]
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "twofour":
                    found += [f"line {node.lineno}: import {a.name}" for p in a.name.split(".") if private(p)]
                    bound.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def test_the_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {"benchmarks/common.py", "benchmarks/step/step_breakdown.py", "scripts/gap_by_eval.py"} <= names


def test_the_check_catches_private_names():
    bad = ("from twofour.training.compare import _band, run_order\nfrom twofour import fp8 as f8\n"
           "import twofour.kernels.compress as ck\nimport twofour\nfrom twofour.cli import main\n"
           "f8._quantize(x)\nck._launch.items()\ntwofour.functional._mvue_24(x)\nmain._x\n")
    assert private_uses(bad) == ["line 1: from twofour.training.compare import _band", "line 6: f8._quantize",
                                 "line 7: ck._launch", "line 8: twofour.functional._mvue_24", "line 9: main._x"]
    good = "from twofour import __version__, fp8\nimport torch\nfp8.quantize(x)\ntorch._scaled_mm(a, b)\nx._y\n"
    assert private_uses(good) == []


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.relative_to(ROOT).as_posix() for p in SCRIPTS])
def test_scripts_use_public_names_only(path):
    assert not private_uses(path.read_text()), f"{path.relative_to(ROOT)} uses private twofour names"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.relative_to(ROOT).as_posix() for p in SCRIPTS])
def test_one_set_of_timers(path):
    """Only benchmarks/common.py times with CUDA events or triton's do_bench; the scripts call it."""
    if path == COMMON:
        return
    text = path.read_text()
    assert not re.search(r"triton\.testing|do_bench|torch\.cuda\.Event\(", text), \
        f"{path.relative_to(ROOT)} times on its own: use benchmarks/common.py's timers"


def test_every_script_answers_a_question_in_its_readme():
    """Each script has a line of its folder's README naming it (its question and how to run it)."""
    for folder in ("benchmarks", "scripts"):
        readme = (ROOT / folder / "README.md").read_text()
        missing = [p.relative_to(ROOT / folder).as_posix() for p in SCRIPTS
                   if p.is_relative_to(ROOT / folder) and p != COMMON and f"`{p.relative_to(ROOT / folder).as_posix()}`"
                   not in readme]
        assert not missing, f"{folder}/README.md does not name {missing}"
    shell = sorted(p.name for p in (ROOT / "scripts").glob("*.sh"))
    assert all(f"`{name}`" in (ROOT / "scripts" / "README.md").read_text() for name in shell)


def test_twofour_bench_is_short():
    n = len((ROOT / "src" / "twofour" / "bench" / "report.py").read_text().splitlines())
    assert n <= 300, f"twofour/bench/report.py has {n} lines: kernel probes and analyses belong in benchmarks/"
