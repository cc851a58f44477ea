"""The library's layers, read from its source: which module imports which, and a picture of it.

    python -m dsv2_lib.tools.layer_map book/_static/layer_map.png

Imports are read from each file's syntax tree (a function-level import counts as much as a top-level
one; a module named in a string, as the package face's lazy imports are, counts too), so the map
shows what the code does, not what it says it does. ``tests/test_layers.py`` holds the graph to
:data:`LAYERS` and the GPU gate uses :func:`imported_modules` to find the engine modules its tests run.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
LAYERS = ("core", "ops", "model", "engine", "serve", "tools", "lessons")  # lowest first: each imports only layers below
MODULE_NAME = re.compile(r"dsv2_lib(\.\w+)+")


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    """``.../dsv2_lib/ops/norm.py`` -> ``dsv2_lib.ops.norm``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: str | None) -> set[str]:
    """Dotted names that the file at ``path`` imports from ``dsv2_lib`` (``from dsv2_lib.ops import norm``
    gives ``dsv2_lib.ops`` and ``dsv2_lib.ops.norm``; the caller keeps those that are modules).
    ``package``: the file's own package, for relative imports; ``None`` outside the library."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
            found.add(node.value)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if package is None:
                    continue
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == "dsv2_lib" or m.startswith("dsv2_lib.")}


def modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """module -> the package's modules it imports (packages' faces included, when imported by name)."""
    known = modules(package_dir)
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in imported_modules(path, package) if m in known and m != name}
    return graph


def layer(module: str) -> int | None:
    """Index of ``module``'s layer in :data:`LAYERS`; None for what stands outside the layers (the
    package face ``dsv2_lib``, the command line ``dsv2_lib.__main__``, a layer's own ``__init__``)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a module to one in a higher layer, as ``"a (ops) imports b (engine)"``."""
    return [f"{m} ({LAYERS[layer(m)]}) imports {d} ({LAYERS[layer(d)]})"
            for m, deps in sorted(graph.items()) for d in sorted(deps)
            if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (cycle := visit(d, path + [d])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m, [m])):
            return cycle
    return None


def draw(graph: dict[str, set[str]], path: Path) -> None:
    """The layers as floors, lowest at the bottom, each module a box with its line count; an arrow
    for every pair of layers joined by an import, labelled with how many imports run that way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = modules()
    floors = {i: sorted(m for m in graph if layer(m) == i and not m.endswith("__init__")) for i in range(len(LAYERS))}
    fig, ax = plt.subplots(figsize=(13, 7.5))
    width = max(len(ms) for ms in floors.values())
    for i, ms in floors.items():
        y = i * 1.2
        ax.add_patch(plt.Rectangle((-0.1, y - 0.45), width + 0.2, 0.9, color=f"C{i}", alpha=0.12, lw=0))
        ax.text(-0.2, y, f"dsv2_lib/{LAYERS[i]}", ha="right", va="center", fontsize=11, weight="bold")
        for j, m in enumerate(ms):
            lines = len(files[m].read_text().splitlines())
            ax.add_patch(plt.Rectangle((j + 0.05, y - 0.3), 0.9, 0.6, facecolor="white", edgecolor=f"C{i}"))
            short = m.rpartition(".")[2]
            ax.text(j + 0.5, y + 0.06, short, ha="center", va="center", fontsize=8 if len(short) < 14 else 6.5)
            ax.text(j + 0.5, y - 0.16, f"{lines} lines", ha="center", va="center", fontsize=6.5, color="0.4")
    pairs: dict[tuple[int, int], int] = {}
    for m, deps in graph.items():
        for d in deps:
            if layer(m) is not None and layer(d) is not None and layer(m) != layer(d):
                pairs[layer(m), layer(d)] = pairs.get((layer(m), layer(d)), 0) + 1
    for (a, b), n in sorted(pairs.items()):
        x = width + 0.4 + 0.35 * (a - b)
        ax.annotate("", xy=(x, b * 1.2 + 0.3), xytext=(x, a * 1.2 - 0.3),
                    arrowprops=dict(arrowstyle="->", color="0.3" if a > b else "red", lw=0.8))
        ax.text(x + 0.04, (a + b) * 0.6, str(n), fontsize=7, color="0.3")
    ax.set_xlim(-2.2, width + 0.6 + 0.35 * len(LAYERS))
    ax.set_ylim(-0.7, len(LAYERS) * 1.2 - 0.4)
    ax.axis("off")
    ax.set_title("dsv2_lib's layers: every import points down (arrows: imports from one layer to a lower one)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "layer_map.png")
    draw(import_graph(), out)
    print(f"wrote {out}")
