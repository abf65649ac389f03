"""The folder tree is the architecture (docs/architecture.md, "Layers"): a module imports
only from its own layer or the layers below, apart from the lazy imports listed there,
and no two modules import each other. Read from the source (ast), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

XSPEC = Path(__file__).resolve().parents[1] / "xspec"

# Bottom to top; a module belongs to the longest prefix listed. The same table is drawn
# in docs/architecture.md.
LAYERS: list[tuple[str, ...]] = [
    ("xspec", "xspec.errors", "xspec.atomic", "xspec.cache", "xspec.capture", "xspec.paths"),  # xspec: the package root (__version__)
    ("xspec.config", "xspec.compose", "xspec.registry", "xspec.sampling", "xspec.tokenizer",
     "xspec.chat", "xspec.metrics"),
    ("xspec.parallel",),
    ("xspec.models.ops", "xspec.models.quantized"),
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(XSPEC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in XSPEC.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The xspec module an imported name lives in (``from xspec.a import b``: xspec.a.b
    when that is a module, else xspec.a)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level imports, function-level imports) of xspec modules; ``if
    TYPE_CHECKING:`` blocks are annotations only and do not count."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
                target = _resolve(n) if n.startswith("xspec") else None
                if target is not None and target != module:
                    (lazy if in_function else eager).add(target)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return eager, lazy - eager


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


def test_no_two_modules_import_each_other() -> None:
    graph = {m: set().union(*imports(m)) for m in MODULES}
    pairs = sorted(
        {tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())}
    )
    assert not pairs, f"modules that import each other: {pairs}"


# what platforms may import from models/: the op protocols and the quantized-weight type
OP_INTERFACE = {"xspec.models", "xspec.models.ops", "xspec.models.quantized"}


def test_platforms_import_only_the_op_protocols_from_models() -> None:
    bad = sorted(
        f"{m} -> {t}"
        for m in MODULES
        if m.startswith("xspec.platforms")
        for t in set().union(*imports(m))
        if t.startswith("xspec.models") and t not in OP_INTERFACE
    )
    assert not bad, "platforms/ may import only the op interface from models/:\n" + "\n".join(bad)
