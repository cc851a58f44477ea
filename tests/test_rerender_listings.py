"""notebooks/rerender_listings.py: a stale listing output is brought back to the code, and nothing else
of the notebook changes."""
import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("rerender_listings", ROOT / "notebooks" / "rerender_listings.py")
rerender_listings = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(rerender_listings)


def test_a_stale_listing_is_rerendered_and_nothing_else_changes(tmp_path):
    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    path = nb_dir / "11_batching.ipynb"
    shutil.copy(ROOT / "notebooks" / "11_batching.ipynb", path)
    shutil.copy(ROOT / "notebooks" / "gpu_cells.py", nb_dir)  # the setup cell imports it
    (tmp_path / "tests").symlink_to(ROOT / "tests")  # the notebooks import ../tests helpers
    committed = json.loads(path.read_text(encoding="utf-8"))
    assert rerender_listings.rerender(path) == ([], [])  # the committed listings are current: no change
    assert json.loads(path.read_text(encoding="utf-8")) == committed
    stale = json.loads(path.read_text(encoding="utf-8"))
    i = next(i for i, c in enumerate(stale["cells"]) if "show_source(Scheduler)" in "".join(c["source"]))
    out = stale["cells"][i]["outputs"][0]["data"]
    out["text/plain"], out["text/html"] = ["class Scheduler:  # an old version\n", "    pass"], ["<pre>old</pre>"]
    path.write_text(json.dumps(stale, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    changed, _ = rerender_listings.rerender(path)
    assert changed == [i]
    now = json.loads(path.read_text(encoding="utf-8"))
    assert now["cells"][i]["outputs"][0]["data"]["text/plain"] == committed["cells"][i]["outputs"][0]["data"]["text/plain"]
    assert "<pre>old</pre>" not in "".join(now["cells"][i]["outputs"][0]["data"]["text/html"])
    for k, (a, b) in enumerate(zip(now["cells"], committed["cells"])):  # every other cell, and the metadata, as committed
        assert k == i or a == b
    assert now["metadata"] == committed["metadata"]
