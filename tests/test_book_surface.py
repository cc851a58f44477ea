"""The book reads as a course: what a reader meets on the page, checked on every run.

* the table of contents reads the chapters in the order of their numbers;
* no development history in the prose: no dates, commit hashes, issue numbers, our machines or sessions;
* every chapter's prose stays within its length budget, and its summary ends with a bridge to the next;
* the setup cell's code is hidden (its provenance output stays) and no progress bar sits in an output;
* listings are excerpts: a longer one is collapsed.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
BOOK_PAGES = sorted((ROOT / "book").glob("*.md"))
MAX_WORDS = 5000  # prose per chapter: every word of its markdown cells, admonitions and solutions included

# What a record of building the engine leaves in prose; none of it belongs in a course.
HISTORY = {
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "a commit hash": r"\bcommit `?[0-9a-f]{7,40}\b|`[0-9a-f]{7,40}`|\+dirty\b",
    "an issue number": r"\bissue #?\d+\b",  # "issue 8"; not "a warp issues 36 MMAs"
    "our machines": r"\bour (?:\d+-core )?(?:development |dev )?machines?\b",
    "a session": r"\b(?:this|one|an earlier|a later|that|the same) session\b",
    "a past run": r"\bthe run before\b|\bbefore the change\b|\bat the time\b|\buncommitted run\b",
}


def markdown(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


def prose_words(texts: list[str]) -> int:
    """Words a reader meets in the markdown: admonitions, exercise solutions and inline code count too."""
    return sum(len(t.split()) for t in texts)


def test_the_table_of_contents_reads_the_chapters_in_the_order_of_their_numbers():
    listed = re.findall(r"file: notebooks/(\d\d)_", (ROOT / "_toc.yml").read_text())
    assert listed == sorted(listed), f"_toc.yml reads the chapters as {listed}"
    assert listed == [p.name[:2] for p in CHAPTERS], "every chapter is in the table of contents, once"


@pytest.mark.parametrize("path", CHAPTERS + [NOTEBOOKS / "A_training_tiny.ipynb"] + BOOK_PAGES,
                         ids=lambda p: p.stem)
def test_no_development_history_in_the_prose(path):
    texts = markdown(path) if path.suffix == ".ipynb" else [path.read_text()]
    found = []
    for what, pattern in HISTORY.items():
        for text in texts:
            for m in re.finditer(pattern, text, flags=re.I):
                found.append(f"{what}: ...{text[max(0, m.start() - 60):m.end() + 20]!r}...")
    assert not found, f"{path.name}:\n" + "\n".join(found)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_stays_within_its_length(path):
    words = prose_words(markdown(path))
    assert words <= MAX_WORDS, f"{path.name}: {words} words of prose, the budget is {MAX_WORDS}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_summary_bridges_to_the_next_chapter(path):
    texts = markdown(path)
    summaries = [t for t in texts if re.search(r"^#+ .*Summary", t, flags=re.M)]
    assert summaries, f"{path.name}: no Summary section"
    tail = "\n".join(texts[texts.index(summaries[-1]):])
    toc = re.findall(r"- file: (\S+)", (ROOT / "_toc.yml").read_text())
    following = Path(toc[toc.index(f"notebooks/{path.stem}") + 1]).stem  # the next page in reading order
    m = re.search(r"\*\*Next:?\*\*:?(.*)", tail, flags=re.S)
    assert m, f"{path.name}: the summary does not end with a **Next:** bridge"
    assert following in m.group(1), f"{path.name}: the Next bridge does not link {following}"


@pytest.mark.parametrize("path", CHAPTERS + [NOTEBOOKS / "A_training_tiny.ipynb"], ids=lambda p: p.stem)
def test_setup_is_hidden_and_outputs_carry_no_progress_bars(path):
    code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert "remove-input" in code[0]["metadata"].get("tags", []), f"{path.name}: the setup cell's code is shown"
    bars = [i for i, c in enumerate(code) for o in c.get("outputs", [])
            if o["output_type"] == "stream" and re.search(r"\d+%\|", "".join(o["text"]))]
    assert not bars, f"{path.name}: progress bars in the outputs of code cells {sorted(set(bars))}"


MAX_LISTING = 70  # lines of an uncollapsed listing: one function or one phase of a kernel beside its prose


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_listings_are_excerpts_and_whole_files_are_collapsed(path):
    """A listing in the reading flow is an excerpt; anything longer is collapsed (``hide-output``)."""
    long = []
    for c in json.loads(path.read_text())["cells"]:
        source = "".join(c["source"])
        if c["cell_type"] != "code" or not re.search(r"\bshow_(source|kernel)\(", source):
            continue
        text = "".join("".join(o.get("data", {}).get("text/plain", "")) for o in c.get("outputs", []))
        if len(text.splitlines()) > MAX_LISTING and "hide-output" not in c["metadata"].get("tags", []):
            long.append(f"{source.splitlines()[-1]}: {len(text.splitlines())} lines")
    assert not long, f"{path.name}: uncollapsed listings over {MAX_LISTING} lines: {long}"
