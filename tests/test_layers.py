"""The library's layers hold: every import inside ``dsv2_lib`` goes to the same layer or one below it,
and no modules import each other in a loop. Read from the source (AST), so a function-level import
counts as much as a top-level one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dsv2_lib"
LAYERS = ("core", "ops", "model", "engine", "lessons", "tools")  # lowest first
ENGINE_MAX_LINES = 400  # no engine module (core .. engine) longer than this


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports(path: Path, known: dict[str, Path], root: Path = ROOT) -> set[str]:
    """The dsv2_lib modules ``path`` imports (``from dsv2_lib.ops import norm`` -> ``dsv2_lib.ops.norm``)."""
    found = set()
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def layer(module: str) -> int | None:
    """Index in LAYERS, or None for the package's face and entry point (``dsv2_lib``, ``__main__``)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in LAYERS else None


GRAPH = {m: imports(p, modules()) for m, p in modules().items()}


def test_every_module_sits_in_a_layer():
    loose = [m for m in GRAPH if layer(m) is None and m not in ("dsv2_lib", "dsv2_lib.__main__")
             and m.rpartition(".")[2] != "__init__" and m.count(".") > 1]
    top_level = [m for m in GRAPH if m.count(".") == 1 and m not in ("dsv2_lib.__main__",) and m.split(".")[1] not in LAYERS]
    assert not loose and not top_level, f"modules outside the layers {LAYERS}: {loose + top_level}"


def test_no_import_runs_up_a_layer():
    upward = [f"{m} ({LAYERS[layer(m)]}) imports {d} ({LAYERS[layer(d)]})"
              for m, deps in GRAPH.items() for d in deps
              if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_no_layer_imports_the_package_face():
    """``from dsv2_lib import LLM`` inside the library would tie every layer to the engine."""
    bad = [m for m, deps in GRAPH.items() if layer(m) is not None and "dsv2_lib" in deps]
    assert not bad, f"modules that import the package face dsv2_lib (import from the layer instead): {bad}"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d] if d in stack else [m, d]
            if d not in state and (cycle := visit(d, stack + [d])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (cycle := visit(m, [m])):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_engine_modules_stay_short():
    long = {m: n for m, p in modules().items() if layer(m) is not None and layer(m) <= LAYERS.index("engine")
            and (n := len(p.read_text().splitlines())) > ENGINE_MAX_LINES}
    assert not long, f"engine modules over {ENGINE_MAX_LINES} lines (split them): {long}"


def test_the_checker_sees_relative_and_absolute_imports(tmp_path):
    """The walk resolves both import forms, inside functions too: an op importing the engine is caught."""
    fake = tmp_path / "dsv2_lib"
    for pkg in ("ops", "engine", "core"):
        (fake / pkg).mkdir(parents=True)
    (fake / "engine" / "llm.py").write_text("X = 1\n")
    (fake / "core" / "config.py").write_text("X = 1\n")
    (fake / "ops" / "norm.py").write_text("import dsv2_lib.core.config\ndef f():\n    from ..engine import llm\n")
    known = modules(fake)
    assert imports(fake / "ops" / "norm.py", known, fake) == {"dsv2_lib.engine.llm", "dsv2_lib.core.config"}
