"""Show the engine's own code inside the book, so that the book cannot drift from it.

A chapter ends a cell with ``show_source(dsv2_lib.roofline.decode_bytes_per_step)`` or
``show_kernel("rmsnorm.cu")``. The returned :class:`Listing` has two representations:

* ``text/plain`` is the exact source text. Cells that show code carry
  ``# NBVAL_CHECK_OUTPUT``, so CI fails when the library changes and the chapter's
  committed output does not;
* ``text/html`` is the same text highlighted by Pygments (inline styles, no stylesheet
  needed): what Jupyter and the built book display.
"""
from __future__ import annotations

import html
import inspect
from pathlib import Path

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import CudaLexer, PythonLexer

from .kernels import KERNEL_DIR

_LEXERS = {"python": PythonLexer, "cuda": CudaLexer}


class Listing:
    """A piece of source code that displays as itself.

    ``text`` is the code, ``language`` ``"python"`` or ``"cuda"``, ``origin`` a short
    label (``"dsv2_lib/roofline.py · parameter_counts"``) shown above the HTML only, so
    that the checked plain text is the code and nothing else.
    """

    def __init__(self, text: str, language: str, origin: str):
        if language not in _LEXERS:
            raise ValueError(f"language must be one of {sorted(_LEXERS)}: {language!r}")
        self.text, self.language, self.origin = text, language, origin

    def __repr__(self) -> str:  # text/plain in Jupyter: exactly the source
        return self.text

    __str__ = __repr__

    def _repr_pretty_(self, p, cycle) -> None:  # IPython's printer: the text, unchanged
        p.text(self.text)

    def _repr_html_(self) -> str:
        formatter = HtmlFormatter(noclasses=True, style="default")
        code = highlight(self.text, _LEXERS[self.language](), formatter)
        caption = (
            '<div style="font-family: monospace; font-size: 85%; opacity: 0.7; '
            f'margin-bottom: 0.2em">{html.escape(self.origin)}</div>'
        )
        return f'<div class="dsv2-listing">{caption}{code}</div>'


def show_source(obj) -> Listing:
    """The source of a function, class, method or module as a :class:`Listing`.

    Decorated functions are unwrapped (``inspect.unwrap``), so the code shown is the
    code that runs. Raises ``TypeError`` for objects without Python source.
    """
    obj = inspect.unwrap(obj)
    try:
        text = inspect.getsource(obj)
    except (TypeError, OSError) as e:
        raise TypeError(f"show_source: no Python source for {obj!r} ({e})") from None
    module = inspect.getmodule(obj)
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
    file = Path(inspect.getsourcefile(obj) or "?")
    if module is None or module.__name__ == "__main__":
        where = file.name
    else:
        init = file.name == "__init__.py"
        where = module.__name__.replace(".", "/") + ("/__init__.py" if init else ".py")
    origin = where if inspect.ismodule(obj) else f"{where} · {name}"
    return Listing(text, "python", origin)


def show_kernel(name: str) -> Listing:
    """The CUDA C file ``kernels_cu/<name>`` (``"rmsnorm.cu"``) as a :class:`Listing`.

    ``name`` is a bare file name ending in ``.cu`` or ``.cuh``; anything else, or a file
    that does not exist, raises an error that lists the kernels available.
    """
    if Path(name).name != name or not name.endswith((".cu", ".cuh")):
        raise ValueError(f"show_kernel: want a name like 'rmsnorm.cu', got {name!r}")
    path = KERNEL_DIR / name
    if not path.is_file():
        kernels = sorted(p.name for p in KERNEL_DIR.glob("*.cu*"))
        raise FileNotFoundError(
            f"show_kernel: no {name!r} in {KERNEL_DIR}; available: {kernels}"
        )
    return Listing(path.read_text(encoding="utf-8"), "cuda", f"kernels_cu/{name}")
