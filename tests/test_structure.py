"""The package's shape holds: dependencies point one way, no module over 400 lines.

Read from the sources' import statements (every import, also those inside functions), so a
change that breaks a rule fails here with the offending module and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "twofour"

#: Each part's level: a module may import only parts of its own level or below, and parts of one
#: level do not import each other unless listed in ALLOWED_SIDEWAYS.
LEVELS = {
    "errors": 0, "version": 0, "integrity": 0, "dispatch": 0, "timing": 0, "functional": 0,
    "kernels": 1,
    "activations": 2,
    "fp8": 3,
    "sparse": 4,
    "models": 5,
    "inference": 6,
    "training": 7,
    "bench": 8,
    "integrations": 8,
    "cli": 9,
    "__main__": 10,
}
ALLOWED_SIDEWAYS: set[tuple[str, str]] = {("dispatch", "timing")}
#: What the kernels know of the rest of the package: the switches and measured choices only.
KERNEL_IMPORTS = {"kernels", "dispatch"}
#: FSDP2's and DTensor's names: the sparse layer holds none of them (``sparse/sharded.py`` does).
SHARDING_NAMES = ("fsdp", "dtensor", "to_local", "full_tensor", "device_mesh", "fully_shard")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), f))
    return out


def _is_module(name: str) -> bool:
    path = PKG.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(mod: str, path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """(imported module, line) for every twofour import in ``path`` (or in ``source``, read as
    that file's), relative ones resolved."""
    is_pkg = path.name == "__init__.py"
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "twofour" or target.startswith("twofour."):
                if target == "twofour" or not node.module and node.level:
                    # ``from twofour import x`` / ``from . import x``: x may be a module
                    found += [(f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target, node.lineno)
                              for a in node.names]
                else:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "twofour"]
    return found


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = _modules()


def test_the_tree_is_found():
    names = {m for m, _ in MODULES}
    assert {"twofour.kernels.ops", "twofour.sparse.layer", "twofour.fp8", "twofour.models", "twofour.inference",
            "twofour.training.loop", "twofour.cli"} <= names
    unknown = sorted(_part(m) for m in names if m != "twofour" and _part(m) not in LEVELS)
    assert not unknown, f"parts of the package with no level in LEVELS: {unknown}"


def test_no_module_imports_the_package_init():
    bad = [f"{m}:{line}" for m, f in MODULES if m != "twofour" for t, line in _imports(m, f) if t == "twofour"]
    assert not bad, f"these import the package's __init__ (import from the defining module instead): {bad}"


def test_dependencies_point_one_way():
    bad = []
    for m, f in MODULES:
        if m == "twofour":
            continue
        here = _part(m)
        for t, line in _imports(m, f):
            there = _part(t)
            if there == here or t == "twofour":
                continue
            sideways = LEVELS[there] == LEVELS[here] and (here, there) not in ALLOWED_SIDEWAYS
            if LEVELS[there] > LEVELS[here] or sideways:
                bad.append(f"{m}:{line} imports {t}")
    layering = "kernels <- fp8 <- sparse <- models <- inference, training <- cli"
    assert not bad, f"imports against the layering ({layering}):\n" + "\n".join(bad)


def test_inference_never_imports_training():
    bad = [f"{m}:{line}" for m, f in MODULES if _part(m) == "inference" for t, line in _imports(m, f)
           if _part(t) == "training"]
    assert not bad, bad


def test_kernels_know_no_file_format():
    bad = [f"{m}:{line} imports {t}" for m, f in MODULES if _part(m) == "kernels" for t, line in _imports(m, f)
           if _part(t) not in KERNEL_IMPORTS]
    assert not bad, bad


def test_kernels_import_no_timer():
    """The kernels time nothing themselves: they ask the dispatch to choose (``graphed=True`` for
    calls that run inside CUDA graphs), which times with ``twofour.timing``."""
    bad = [f"{m}:{line} imports {t}" for m, f in MODULES if _part(m) == "kernels" for t, line in _imports(m, f)
           if _part(t) == "timing"]
    assert not bad, bad
    assert "timing" not in KERNEL_IMPORTS


def test_the_sparse_layer_knows_nothing_of_fsdp2():
    """``sparse/layer.py`` reads as a Linear with a recipe: what a sharded weight needs lives in
    ``sparse/sharded.py`` (its code, comments and docstrings name neither FSDP2 nor DTensor)."""
    lines = (PKG / "sparse" / "layer.py").read_text().lower().splitlines()
    bad = [f"line {i}: {name}" for i, line in enumerate(lines, 1) for name in SHARDING_NAMES if name in line]
    assert not bad, f"FSDP2/DTensor names in sparse/layer.py (they belong in sparse/sharded.py): {bad}"


@pytest.mark.parametrize("mod,path", MODULES, ids=[m for m, _ in MODULES])
def test_no_module_over_400_lines(mod, path):
    n = len(path.read_text().splitlines())
    assert n <= 400, f"{mod} has {n} lines: split it by job"


def test_the_checks_catch_a_bad_import():
    """The import reader resolves relative imports (else every rule above would pass on nothing)."""
    source = "from ..training.runs import CKPT\nfrom . import ops\nimport twofour\n"
    got = [t for t, _ in _imports("twofour.kernels.x", PKG / "kernels" / "x.py", source)]
    assert got == ["twofour.training.runs", "twofour.kernels.ops", "twofour"]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> modules it imports): its strongly connected
    parts of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every import: deferred and type-only ones too;
    a package's ``__init__`` left out, as it only gathers names)."""
    names = {m for m, _ in MODULES}
    packages = {m for m in names if (PKG.parent / m.replace(".", "/")).is_dir()}
    return {m: {t for t, _ in _imports(m, f) if t in names - packages and t != m}
            for m, f in MODULES if f.name != "__init__.py"}


def test_no_import_circles():
    """No module imports, even inside a function or for types alone, a module that imports it
    back: each floor of the package imports downward only."""
    circles = _circles(_import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


#: Third-party modules whose private names twofour calls on purpose (torch._foreach_*, ...).
THIRD_PARTY = {"torch", "triton", "tl", "np", "numpy", "F", "nn", "dist", "inductor", "dynamo", "functools"}
#: Private names of third-party objects read on purpose: argparse's list of a parser's actions,
#: a tensor's version counter (bumped by every in-place write: the fast path's cache key).
THIRD_PARTY_PRIVATE = {"_actions", "_version"}


def _private_reads(source: str) -> list[tuple[int, str]]:
    """(line, ``x._name``) for every read of another object's private attribute that the module
    itself does not define: ``self``, ``cls`` and third-party modules' names left out."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {t.attr for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}
    own |= {t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        root = node.value
        while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in ({"self", "cls"} | THIRD_PARTY):
            continue
        if node.attr not in own | THIRD_PARTY_PRIVATE:
            bad.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return bad


def test_no_module_reads_another_modules_private_state():
    """A module's state is read through its public names: no ``x._name`` of a name that the
    reading module does not define itself."""
    bad = [f"{m}:{line} reads {what}" for m, f in MODULES for line, what in _private_reads(f.read_text())]
    assert not bad, "private state read from another module (add a public name):\n" + "\n".join(bad)


def test_the_structure_checks_catch_a_circle_and_a_private_read():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _private_reads("def f(layer):\n    return layer._dense\n") == [(2, "layer._dense")]
    assert _private_reads("class A:\n    def _x(self):\n        return other._x, self._y, torch._foreach_add_\n") == []


@pytest.mark.parametrize("mod,path", MODULES, ids=[m for m, _ in MODULES])
def test_no_function_over_60_lines(mod, path):
    """A function reads in one screen: none in the package is over 60 lines (split it by step)."""
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines, line {n.lineno})"
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 60]
    assert not long, f"{mod}: {long}"
