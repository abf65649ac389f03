"""The folder tree is the architecture (docs/architecture.md, "Layers"): a module imports
only from its own layer or the layers below, apart from the lazy imports listed there;
no import cycle of any length (lazy imports included); only ``xspec.build`` (and the
few modules named below) reaches into adaptive speculation. Read from the source (ast),
so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

XSPEC = Path(__file__).resolve().parents[1] / "xspec"

# Bottom to top; a module belongs to the longest prefix listed. The same table is drawn
# in docs/architecture.md.
LAYERS: list[tuple[str, ...]] = [
    ("xspec", "xspec.version", "xspec.errors", "xspec.atomic", "xspec.cache", "xspec.capture", "xspec.paths", "xspec.jsonfile"),  # xspec: the package root
    ("xspec.config", "xspec.compose", "xspec.registry", "xspec.sampling", "xspec.tokenizer",
     "xspec.grammar", "xspec.json_schema", "xspec.chat", "xspec.metrics", "xspec.acceptance"),
    ("xspec.parallel",),
    ("xspec.models.ops", "xspec.models.quantized", "xspec.models.invariant"),
    ("xspec.platforms",),
    ("xspec.models",),
    ("xspec.spec",),
    ("xspec.engine",),
    ("xspec.build",),
    ("xspec.run", "xspec.api", "xspec.bench"),
    ("xspec.__main__", "xspec.plan", "xspec.train", "xspec.serve"),
]  # fmt: skip

# Lazy (function-level) imports that go up, each with its reason in docs/architecture.md.
LAZY_UPWARD: set[tuple[str, str]] = {
    ("xspec", "xspec.api"),  # xspec.LLM, imported on first use so that `import xspec` is light
    ("xspec.config", "xspec.registry"),  # names the registries know, for messages
    ("xspec.config", "xspec.parallel.topology"),  # the torchrun world size
    ("xspec.registry", "xspec.platforms.base"),  # vets a loaded plugin against its contract
    ("xspec.registry", "xspec.models.family"),
    ("xspec.registry", "xspec.spec.drafter"),
}


def module_name(path: Path, root: Path = XSPEC) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    return {module_name(p, root): p for p in root.rglob("*.py")}


MODULES = modules_under(XSPEC)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name lives in (``from xspec.a import b``: xspec.a.b when
    that is a module, else xspec.a)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, modules: dict[str, Path] = MODULES) -> tuple[set[str], set[str]]:
    """(module-level imports, function-level imports) of the package's modules; ``if
    TYPE_CHECKING:`` blocks are annotations only and do not count."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = module.split(".")[0]
    eager: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - child.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                names = [f"{base}.{a.name}" for a in child.names]
            for n in names:
                target = _resolve(n, modules) if n.split(".")[0] == top else None
                if target is not None and target != module:
                    (lazy if in_function else eager).add(target)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return eager, lazy - eager


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Every set of modules that import one another round a cycle, of any length, lazy
    imports included (the strongly connected components of the import graph with more
    than one module; Tarjan's algorithm, iterative), each sorted."""
    graph = {m: sorted(set().union(*imports(m, modules))) for m in sorted(modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def _under(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` or inside it (the root package ``xspec`` contains only itself)."""
    return name == prefix or (prefix != "xspec" and name.startswith(prefix + "."))


def layer(module: str) -> int:
    best, rank = "", -1
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if _under(module, prefix) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return rank


def _listed(importer: str, imported: str) -> bool:
    return any(_under(importer, a) and _under(imported, b) for a, b in LAZY_UPWARD)


def test_every_module_is_in_a_layer() -> None:
    for m in MODULES:
        layer(m)


def test_imports_only_go_down() -> None:
    up = []
    for m in MODULES:
        eager, lazy = imports(m)
        for t in eager | lazy:
            if layer(t) > layer(m) and (t in eager or not _listed(m, t)):
                up.append(f"{m} -> {t}" + ("" if t in eager else " (lazy, not listed)"))
    assert not up, "imports that go up a layer:\n" + "\n".join(sorted(up))


def test_no_import_cycle_of_any_length() -> None:
    assert import_cycles(MODULES) == [], "modules that import one another round a cycle"


def test_a_planted_three_module_cycle_is_found(tmp_path: Path) -> None:
    """a -> b -> c -> a (one import lazy, one relative), beside a module outside it: the
    check finds the three, which a search for pairs would not."""
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from planted import c\n")
    (pkg / "c.py").write_text("from .a import x\nimport planted.d\n")
    (pkg / "d.py").write_text("import planted.sub\n")
    modules = modules_under(pkg)
    assert import_cycles(modules) == [["planted.a", "planted.c", "planted.sub.b"]]
    (pkg / "sub" / "b.py").write_text("import planted.d\n")  # the circle broken
    assert import_cycles(modules) == []


# Modules outside xspec.spec.adaptive that may name it: build wires it; training fits the
# calibration it reads; the drafters with a confidence head read their calibration file.
ADAPTIVE_USERS = {"xspec.build", "xspec.train.calibrate", "xspec.spec.dspark", "xspec.spec.block"}


def test_adaptive_speculation_is_reached_through_build_only() -> None:
    """The engine, the step and the run's report see a depth policy and plain figures
    (xspec.spec.policy), never the adaptive package."""
    users = {
        m
        for m in MODULES
        if not _under(m, "xspec.spec.adaptive")
        and any(_under(t, "xspec.spec.adaptive") for t in set().union(*imports(m)))
    }
    assert users == ADAPTIVE_USERS


# what platforms may import from models/: the op protocols, the quantized-weight type and
# the row-invariance probe
OP_INTERFACE = {
    "xspec.models",
    "xspec.models.ops",
    "xspec.models.quantized",
    "xspec.models.invariant",
}


def test_platforms_import_only_the_op_protocols_from_models() -> None:
    bad = sorted(
        f"{m} -> {t}"
        for m in MODULES
        if m.startswith("xspec.platforms")
        for t in set().union(*imports(m))
        if t.startswith("xspec.models") and t not in OP_INTERFACE
    )
    assert not bad, "platforms/ may import only the op interface from models/:\n" + "\n".join(bad)
