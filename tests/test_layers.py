"""The library's layers hold (``dsv2_lib/tools/layer_map.py`` reads the imports): every import inside
``dsv2_lib`` goes to the same layer or one below it, no modules import each other in a loop, no
layer leans on the package face, and the engine's modules stay short enough to read."""
from __future__ import annotations

from pathlib import Path

from dsv2_lib.tools.layer_map import LAYERS, find_cycle, import_graph, imported_modules, layer, modules, upward_imports

ENGINE_MAX_LINES = 400  # no module of core .. engine longer than this
GRAPH = import_graph()
ROOT = Path(__file__).resolve().parent.parent


def test_every_module_sits_in_a_layer():
    outside = [m for m in GRAPH if layer(m) is None and m not in ("dsv2_lib", "dsv2_lib.__main__")
               and m.removeprefix("dsv2_lib.") not in LAYERS]
    assert not outside, f"modules outside the layers {LAYERS}: {outside}"


def test_no_import_runs_up_a_layer():
    upward = upward_imports(GRAPH)
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_no_layer_imports_the_package_face():
    """``from dsv2_lib import LLM`` inside a layer would tie it to the engine."""
    bad = [m for m, deps in GRAPH.items() if layer(m) is not None and "dsv2_lib" in deps]
    assert not bad, f"modules that import the package face dsv2_lib (import from the layer instead): {bad}"


def test_no_import_cycle():
    assert find_cycle(GRAPH) is None, "import cycle: " + " -> ".join(find_cycle(GRAPH))


def test_engine_modules_stay_short():
    long = {m: n for m, p in modules().items() if layer(m) is not None and layer(m) <= LAYERS.index("engine")
            and (n := len(p.read_text().splitlines())) > ENGINE_MAX_LINES}
    assert not long, f"engine modules over {ENGINE_MAX_LINES} lines (split them): {long}"


def test_the_book_maps_every_module():
    """Appendix C's layer table names every module, so the map cannot fall behind the code."""
    text = (ROOT / "book" / "testing.md").read_text()
    missing = [m for m in GRAPH if layer(m) is not None and not m.endswith(tuple(LAYERS))
               and f"`{m.rpartition('.')[2]}`" not in text]
    assert not missing, f"modules missing from the layer table in book/testing.md: {missing}"


def test_the_reader_sees_relative_absolute_and_lazy_imports(tmp_path):
    """Imports in both forms and inside functions, and modules named in strings, are all seen: an op
    importing the engine is an upward import, and a cycle through a string import is a cycle."""
    pkg = tmp_path / "dsv2_lib"
    for sub in ("ops", "engine", "core"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "core" / "config.py").write_text("X = 1\n")
    (pkg / "engine" / "llm.py").write_text("import importlib\nM = importlib.import_module('dsv2_lib.ops.norm')\n")
    (pkg / "ops" / "norm.py").write_text("import dsv2_lib.core.config\ndef f():\n    from ..engine import llm\n")
    assert imported_modules(pkg / "ops" / "norm.py", "dsv2_lib.ops") >= {"dsv2_lib.engine.llm", "dsv2_lib.core.config"}
    graph = import_graph(pkg)
    assert upward_imports(graph) == ["dsv2_lib.ops.norm (ops) imports dsv2_lib.engine.llm (engine)"]
    assert find_cycle(graph) in (["dsv2_lib.engine.llm", "dsv2_lib.ops.norm", "dsv2_lib.engine.llm"],
                                 ["dsv2_lib.ops.norm", "dsv2_lib.engine.llm", "dsv2_lib.ops.norm"])
