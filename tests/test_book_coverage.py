"""The book covers the whole engine: every public function, class and method of ``dsv2_lib``, every
``__global__`` kernel of ``kernels_cu/*.cu`` is shown live (``show_source`` of it, its class or its
module; ``show_kernel`` of its file or of an excerpt that holds it) by exactly one chapter, and every
``.cuh`` header by at least one (its helpers serve several chapters), except what ``PENDING`` assigns to a chapter not yet written. PENDING must only shrink:
when a chapter lands, its entries leave the list (the test fails while a shown item is still listed).
"""
import ast
import importlib
import inspect
import json
import pkgutil
import re
from collections import defaultdict
from pathlib import Path

import dsv2_lib
from dsv2_lib.core.kernels import KERNEL_DIR
from dsv2_lib.tools.show import show_kernel

ROOT = Path(__file__).resolve().parent.parent

# item -> chapter that will show it
PENDING: dict[str, str] = {}
# modules described in a markdown page rather than shown in a chapter: the course's maintenance, and the
# serving surface that sits on top of chapter 11's engine
NOT_TAUGHT = {
    "layer_map": "appendix C (book/testing.md) shows its picture and describes the layer test",
    "live_engine": "the serving page (book/serving.md) describes it and shows it in use",
    "openai_server": "the serving page (book/serving.md) describes the server and drives it with the openai client",
    "calibrate": "the real-model page (book/real_model.md) describes the command and its file; chapter 14 names it",
}
CHAPTERS = {f"{i:02d}" for i in range(15)} | set("ABCD")


def public_items() -> dict[str, object]:
    """``module.name`` (and ``module.Class.method``) -> object, for everything public in dsv2_lib."""
    items = {}
    for info in pkgutil.walk_packages(dsv2_lib.__path__, "dsv2_lib."):
        short = info.name.rpartition(".")[2]  # module names are unique across the layers
        if short.startswith("_") or info.ispkg or short in NOT_TAUGHT:
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                items[f"{short}.{name}"] = obj
            if inspect.isclass(obj):
                for meth, fn in vars(obj).items():
                    if not meth.startswith("_") and inspect.isfunction(fn):
                        items[f"{short}.{name}.{meth}"] = fn
    return items


def kernel_files() -> list[str]:
    return sorted(p.relative_to(KERNEL_DIR).as_posix() for p in KERNEL_DIR.rglob("*") if p.suffix in (".cu", ".cuh"))


GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)\s*\(")


def kernels() -> list[str]:
    """What the book must show, per kernel file: ``file.cu:kernel`` for each ``__global__`` function of a
    ``.cu`` file, and each ``.cuh`` header as a whole (its device helpers are shown with their users)."""
    keys = []
    for name in kernel_files():
        text = (KERNEL_DIR / name).read_text()
        keys += [f"{name}:{k}" for k in GLOBAL.findall(text)] if name.endswith(".cu") else [name]
    return keys


def kernel_shown(call: ast.Call) -> list[str]:
    """The kernel keys a ``show_kernel(...)`` call shows: every kernel of the file for the whole file,
    the kernels whose ``__global__`` line is inside an excerpt, the header for any part of a ``.cuh``."""
    args = [ast.literal_eval(a) for a in call.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    name = args[0]
    if name.endswith(".cuh"):
        return [name]
    text = show_kernel(*args, **kwargs).text
    return [f"{name}:{k}" for k in GLOBAL.findall(text)]


def shows() -> dict[str, set[str]]:
    """item or kernel file -> chapters whose notebook shows it (a shown class covers its methods)."""
    items = public_items()
    modules = {k.split(".")[0] for k in items}
    covered = defaultdict(set)
    for nb in sorted((ROOT / "notebooks").glob("[0-9A-D]*_*.ipynb")):
        chapter = nb.name.split("_")[0]
        code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        for node in ast.walk(ast.parse(code.replace("%%gpu\n", ""))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "show_kernel":
                for key in kernel_shown(node):
                    covered[key].add(chapter)
        for expr in re.findall(r"show_source\(\s*([\w.]+)\s*\)", code):
            if expr in modules:  # a whole module: everything in it
                for k in items:
                    if k.startswith(expr + "."):
                        covered[k].add(chapter)
                continue
            key = resolve(expr, items)
            if key is None:  # a private method, a classmethod or a property: not an item the book must show
                continue
            covered[key].add(chapter)
            if inspect.isclass(items[key]):
                for k in items:
                    if k.startswith(key + "."):
                        covered[k].add(chapter)
            elif key.count(".") == 2:  # a method shown on its own also shows where its class lives
                covered[key.rsplit(".", 1)[0]].add(chapter)
    return covered


def resolve(expr: str, items: dict) -> str | None:
    """``roofline.parameter_counts``, ``kernels.KernelFile``, ``mla.MLA.decode_attention``, ``show_source`` -> item
    key; ``None`` for what the book need not show (``Scheduler._prefill``, a classmethod, a property's ``.func``)."""
    matches = [k for k in items if k == expr or k.endswith("." + expr)]
    if not matches and any(part.startswith("_") or part == "func" for part in expr.split(".")[1:]):
        return None
    if not matches and "." in expr and resolve(expr.rsplit(".", 1)[0], items) is not None:
        return None  # an attribute of a tracked class that is not a plain method (classmethod, property)
    assert len(matches) == 1, f"show_source({expr}): cannot tell which dsv2_lib object this is ({matches})"
    return matches[0]


def pending_chapter(key: str) -> str | None:
    """The chapter an item is pending for: its own entry, or its class's (methods follow their class)."""
    return PENDING.get(key) or (PENDING.get(key.rsplit(".", 1)[0]) if key.count(".") == 2 else None)


def test_pending_entries_are_real_and_name_a_chapter():
    known = set(public_items()) | set(kernels())
    assert not set(PENDING) - known, f"PENDING names things that do not exist: {sorted(set(PENDING) - known)}"
    assert set(PENDING.values()) <= CHAPTERS


def test_everything_is_shown_by_exactly_one_chapter_or_pending():
    covered = shows()
    items = public_items()
    problems = []
    for key in sorted(set(items) | set(kernels())):
        chapters = covered.get(key, set())
        is_class = key in items and inspect.isclass(items[key])
        if pending_chapter(key):
            if chapters:
                problems.append(f"{key}: shown in chapter {sorted(chapters)} but still PENDING for {pending_chapter(key)}")
        elif not chapters:
            problems.append(f"{key}: shown by no chapter (show it, or add it to PENDING with its chapter)")
        elif len(chapters) > 1 and not is_class and not key.endswith(".cuh"):  # a header's helpers serve many chapters
            problems.append(f"{key}: shown by chapters {sorted(chapters)}; one chapter owns it")
    assert not problems, "\n".join(problems)
