"""Imports go one way through the layers, with no cycles and no private names across modules.

Layers, lowest first (a module may import its own layer or lower ones)::

    pallas_kernels  ->  jaxinfer core  ->  sharding, checkpoints  ->  jaxinfer.model
        ->  jaxinfer serving  ->  CLI and perf tools (and the jaxinfer package's public names)

Read from the source with ``ast`` (nothing is imported); every import statement counts,
including ones inside functions, except those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "jaxinfer", "sharding", "checkpoints")

CORE = {"errors", "config", "params", "quantize", "tokenizer", "paged_cache", "attention",
        "sampling", "speculative", "presets", "roofline", "structured", "xla_flags"}
SERVING = {"requests", "engine", "replicas", "runner", "generate", "loading", "server",
           "engine_process"}
TOOLS = {"cli", "perf_cli", "benchmark", "lm_eval_adapter"}


def group(module: str) -> str:
    """The package-level unit a module belongs to (jaxinfer is split by layer)."""
    top, _, rest = module.partition(".")
    if top != "jaxinfer":
        return top
    name = rest.split(".")[0]
    if name in CORE:
        return "jaxinfer core"
    if name == "model":
        return "jaxinfer.model"
    if name in SERVING:
        return "jaxinfer serving"
    if name in TOOLS:
        return "cli/perf tools"
    if name == "":  # the package's public names: the top of the stack, imported lazily
        return "jaxinfer package"
    raise AssertionError(f"{module}: put it in a layer in tests/test_layering.py")


LAYER = {"pallas_kernels": 0, "jaxinfer core": 1, "sharding": 2, "checkpoints": 2,
         "jaxinfer.model": 3, "jaxinfer serving": 4, "cli/perf tools": 5, "jaxinfer package": 5}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    skip.add(id(n))
    return skip


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of every project import in ``path`` (absolute names)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_blocks(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [a.name for a in node.names]
            # ``from pkg import submodule`` imports the submodule
            subs = [n for n in names if (ROOT / base.replace(".", "/") / n).is_dir()
                    or (ROOT / base.replace(".", "/") / f"{n}.py").is_file()]
            out.append((base, [n for n in names if n not in subs], node.lineno))
            out += [(f"{base}.{n}", [], node.lineno) for n in subs]
    return [(m, n, line) for m, n, line in out if m.split(".")[0] in PACKAGES]


FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
MODULES = {module_name(p): p for p in FILES}


def edges() -> dict[str, set[str]]:
    """Module -> project modules it imports. Importing ``pkg.mod`` of another package also
    runs ``pkg/__init__.py``, so that is an edge too."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, _, _ in imports(path):
            while target not in MODULES and "." in target:  # ``pkg.mod.attr`` style
                target = target.rpartition(".")[0]
            graph[mod].add(target)
            top = target.split(".")[0]
            if top != mod.split(".")[0]:
                graph[mod].add(top)
    for mod in graph:
        graph[mod].discard(mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    for mod in MODULES:
        assert group(mod) in LAYER


def test_no_import_cycles_between_modules():
    assert cycles(edges()) == []


def test_no_import_cycles_between_packages():
    graph: dict[str, set[str]] = {}
    for mod, targets in edges().items():
        graph.setdefault(group(mod), set()).update(group(t) for t in targets)
    for g in graph:
        graph[g].discard(g)
    assert cycles(graph) == []


def test_imports_go_down_the_layers():
    bad = []
    for mod, targets in edges().items():
        for t in targets:
            if t == "jaxinfer":
                continue  # the lazy package module: checked to import nothing below
            if LAYER[group(t)] > LAYER[group(mod)]:
                bad.append(f"{mod} ({group(mod)}) imports {t} ({group(t)})")
    assert bad == []


def test_pallas_kernels_imports_no_other_project_package():
    for mod, path in MODULES.items():
        if mod.startswith("pallas_kernels"):
            assert {m.split(".")[0] for m, _, _ in imports(path)} <= {"pallas_kernels"}, mod


def test_jaxinfer_package_imports_its_names_lazily():
    """``import jaxinfer.config`` (from sharding, checkpoints) runs ``jaxinfer/__init__.py``:
    it must not import the engine, which imports those packages. Its one eager import,
    ``xla_flags`` (set before any backend starts), imports nothing of the project."""
    eager = {m for m, _, _ in imports(ROOT / "jaxinfer" / "__init__.py")}
    assert eager == {"jaxinfer", "jaxinfer.xla_flags"}
    assert imports(ROOT / "jaxinfer" / "xla_flags.py") == []


def test_no_private_names_across_modules():
    bad = []
    for mod, path in MODULES.items():
        for target, names, line in imports(path):
            other_pkg = target.split(".")[0] != mod.split(".")[0]
            if other_pkg and any(p.startswith("_") for p in target.split(".")):
                bad.append(f"{mod}:{line} imports private module {target}")
            bad += [f"{mod}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
    assert bad == []


def test_the_checks_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert LAYER[group("jaxinfer.engine")] > LAYER[group("sharding.rules")]
    found = {m: names for m, names, _ in imports(ROOT / "jaxinfer" / "model.py")}
    assert "init_params" in found["jaxinfer.params"] and "sharding.attention" in found
