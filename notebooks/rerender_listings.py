"""Bring the code listings of committed notebooks up to date, on any machine, without executing them.

    python notebooks/rerender_listings.py notebooks/11_batching.ipynb [...]

A change to the engine that a chapter shows (``show_source``, ``show_kernel``, a ``Listing``) makes the
chapter's checked listing outputs stale; when the change alters nothing the notebook computes, those
listings are all that must change, and a GPU run (``execute.py``) is not needed for them. This script
runs each notebook's setup cell (the first code cell) and its cells of pure definitions (imports,
``def``, ``class``, constant assignments), then evaluates every cell that displays a ``Listing`` and
replaces that output's text and HTML, where its text changed. Nothing else in the notebook is touched:
other outputs, execution counts and metadata stay those of the GPU run. (An unchanged text keeps its
committed HTML, which the GPU machine's Pygments version rendered.) A listing cell that needs state a
skipped cell computes is reported and left alone.
"""
from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

from dsv2_lib.tools.show import Listing


def _lines(text: str) -> list[str]:
    """Text as a notebook stores it: lines that keep their newline."""
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def _definitions_only(tree: ast.Module) -> bool:
    """The cell only imports, defines functions or classes, or assigns values computed without a call:
    safe and cheap to run."""
    return bool(tree.body) and all(
        isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))
        or (isinstance(node, ast.Assign) and not any(isinstance(n, ast.Call) for n in ast.walk(node.value)))
        for node in tree.body)


def _without_gpu_magic(source: str) -> str:
    """A cell's Python: a ``%%gpu`` first line (gpu_cells.py) removed; the body is plain Python."""
    return source.partition("\n")[2] if source.split("\n", 1)[0].strip() == "%%gpu" else source


def _listing_outputs(source: str, namespace: dict) -> list[Listing] | None:
    """The Listings the cell displays, in output order (``display(...)`` calls, then its last expression),
    or None when it displays none or cannot be evaluated without the cells skipped."""
    tree = ast.parse(source)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return None
    shown: list = []
    namespace["display"] = shown.append
    try:
        exec(compile(ast.Module(tree.body[:-1], []), "<cell>", "exec"), namespace)
        shown.append(eval(compile(ast.Expression(tree.body[-1].value), "<cell>", "eval"), namespace))
    except Exception:
        return None
    return shown if shown and all(isinstance(s, Listing) for s in shown) else None


def rerender(path: Path) -> tuple[list[int], list[int]]:
    """Update ``path`` in place: (cells whose listings changed, listing cells that could not be evaluated)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__main__"}
    changed, skipped = [], []
    cwd = os.getcwd()
    os.chdir(path.parent)  # notebooks run from their own folder (relative paths such as ../tests)
    sys.path.insert(0, str(path.parent))  # ... and import from it (gpu_cells), as a Jupyter kernel does
    try:
        for i in code:
            cell = nb["cells"][i]
            source = _without_gpu_magic("".join(cell["source"]))
            tree = ast.parse(source)
            if i == code[0]:
                exec(compile(source, f"{path.name} cell {i}", "exec"), namespace)
                continue
            if _definitions_only(tree):
                try:
                    exec(compile(source, f"{path.name} cell {i}", "exec"), namespace)
                except Exception:  # a default argument or class body that needs a skipped cell's state
                    pass
                continue
            if not any(k in source for k in ("show_source", "show_kernel", "Listing", "excerpt")):
                continue
            listings = _listing_outputs(source, namespace)
            outputs = [o for o in cell["outputs"] if o["output_type"] in ("display_data", "execute_result")]
            if listings is None or len(listings) != len(outputs):
                skipped.append(i)
                continue
            for out, listing in zip(outputs, listings):
                if out["data"].get("text/plain") != _lines(repr(listing)):
                    out["data"] = {"text/html": _lines(listing._repr_html_()), "text/plain": _lines(repr(listing))}
                    changed.append(i)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(path.parent))
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return sorted(set(changed)), skipped


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        changed, skipped = rerender(Path(arg))
        print(f"{arg}: re-rendered cells {changed}" + (f"; could not evaluate cells {skipped}" if skipped else ""))
