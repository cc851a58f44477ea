"""Show the engine's own code inside the book, so that the book cannot drift from it.

A chapter ends a cell with ``show_source(dsv2_lib.tools.roofline.decode_bytes_per_step)`` or
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

from dsv2_lib.core.kernels import KERNEL_DIR

_LEXERS = {"python": PythonLexer, "cuda": CudaLexer}


class Listing:
    """A piece of source code that displays as itself.

    ``text`` is the code, ``language`` ``"python"`` or ``"cuda"``, ``origin`` a short
    label (``"dsv2_lib/tools/roofline.py · parameter_counts"``) shown above the HTML only, so
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


def show_source(obj, lines: tuple[str, str | None] | None = None) -> Listing:
    """The source of a function, class, method or module as a :class:`Listing`.

    Decorated functions are unwrapped (``inspect.unwrap``), so the code shown is the
    code that runs. Raises ``TypeError`` for objects without Python source. ``lines = (first, stop)``
    narrows it as :func:`show_kernel` does (say, a launcher's launch without its argument checks).
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
    if lines is not None:
        text = _stretch(text, *lines, where=origin)
    return Listing(text, "python", origin)


def show_kernel(name: str, part: str | None = None, lines: tuple[str, str | None] | None = None) -> Listing:
    """The CUDA C file ``kernels_cu/<name>`` (``"rmsnorm.cu"``) as a :class:`Listing`, or one ``part``
    of it: the definition of the function, struct or namespace of that name (``"moe_align"``), with
    the comment block and ``template <...>`` line above it, as :func:`_excerpt` cuts it.
    ``lines = (first, stop)`` narrows that to a stretch of a long definition: from the first line
    that contains ``first`` up to, not including, the next line that contains ``stop`` (for
    example two section comments; ``stop = None``: to the end of the part), so a chapter can show one
    phase of a kernel next to its prose.

    ``name`` is a file name under ``kernels_cu/`` ending in ``.cu`` or ``.cuh`` (``"lessons/gemm.cu"``
    for a lesson's kernel); anything else, or a file that does not exist, raises an error that lists
    the kernels available.
    """
    if ".." in Path(name).parts or Path(name).is_absolute() or not name.endswith((".cu", ".cuh")):
        raise ValueError(f"show_kernel: want a name like 'rmsnorm.cu' or 'lessons/gemm.cu', got {name!r}")
    path = KERNEL_DIR / name
    if not path.is_file():
        kernels = sorted(p.relative_to(KERNEL_DIR).as_posix() for p in KERNEL_DIR.rglob("*.cu*"))
        raise FileNotFoundError(
            f"show_kernel: no {name!r} in {KERNEL_DIR}; available: {kernels}"
        )
    text = path.read_text(encoding="utf-8")
    if part is None:
        if lines is not None:
            raise ValueError("show_kernel: lines=(first, stop) narrows a part; name the part too")
        return Listing(text, "cuda", f"kernels_cu/{name}")
    excerpt = _excerpt(text, part, name)
    if lines is not None:
        excerpt = _stretch(excerpt, *lines, where=f"{name} · {part}")
    return Listing(excerpt, "cuda", f"kernels_cu/{name} · {part}")


def _stretch(text: str, first: str, stop: str | None, where: str) -> str:
    """The lines of ``text`` from the first that contains ``first`` to the next that contains ``stop``
    (excluded), or to the end when ``stop`` is ``None``; a marker that is not found is an error naming it."""
    rows = text.splitlines(keepends=True)
    try:
        a = next(i for i, row in enumerate(rows) if first in row)
        b = len(rows) if stop is None else next(i for i in range(a + 1, len(rows)) if stop in rows[i])
    except StopIteration:
        raise KeyError(f"{where} has no line with {first!r} followed by one with {stop!r}") from None
    return "".join(rows[a:b])


def _blank_comments(code: str) -> str:
    """``code`` with every comment and string literal replaced by spaces (newlines kept), so that
    braces and names inside them are not counted; offsets stay those of ``code``."""
    out, i, n = list(code), 0, len(code)
    while i < n:
        two = code[i:i + 2]
        if two == "//":
            j = code.find("\n", i)
            j = n if j < 0 else j
        elif two == "/*":
            j = code.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif code[i] == '"':
            j = i + 1
            while j < n and code[j] != '"':
                j += 2 if code[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _excerpt(text: str, part: str, filename: str = "the file") -> str:
    """The definition of ``part`` in the CUDA source ``text``: the first top-level function,
    ``struct`` or ``namespace`` of that name that has a body, from its comment block and
    ``template`` line to its closing brace. Raises ``KeyError`` naming the definitions there are."""
    import re

    code = _blank_comments(text)
    depth, parens, tops = 0, 0, []  # names at brace and parenthesis depth 0 start definitions
    starts = {}
    pattern = r"[{}()]|\b(?:struct|namespace)\s+(?:alignas\s*\(\s*\d+\s*\)\s*)?(\w+)|\b(\w+)(?=\s*(?:<[^<>;{}()]*>)?\s*\()"
    for m in re.finditer(pattern, code):
        tok = m.group(0)
        if tok in "{}()":
            depth += {"{": 1, "}": -1}.get(tok, 0)
            parens += {"(": 1, ")": -1}.get(tok, 0)
        elif depth == 0 and parens == 0:
            word = m.group(1) or m.group(2)
            if word not in ("if", "for", "while", "switch", "return", "sizeof", "alignas", "defined",
                            "__launch_bounds__", "static_cast", "reinterpret_cast", "float", "int"):
                starts.setdefault(word, []).append(m.start())
                tops.append(word)
    if part not in starts:
        names = sorted({w for w in tops if not w.startswith("_")})
        raise KeyError(f"show_kernel: no definition {part!r} in {filename}; top-level names: {names}")
    def body_of(at: int) -> int:  # where the definition's body opens; -1 for a declaration
        body, semicolon = code.find("{", at), code.find(";", at)
        return -1 if body < 0 or 0 <= semicolon < body else body

    at = next((a for a in starts[part] if body_of(a) >= 0), None)
    if at is None:
        raise KeyError(f"show_kernel: {part!r} in {filename} is declared without a body")
    body = body_of(at)
    depth, end = 0, body
    for end in range(body, len(code)):
        depth += {"{": 1, "}": -1}.get(code[end], 0)
        if depth == 0:
            break
    end += 1
    line_end = text.find("\n", end)
    end = len(text) if line_end < 0 else line_end  # the rest of the closing line: `};`, a trailing comment
    lines = text[:at].split("\n")
    head = len(lines) - 1  # the definition's own line; then the template line and comments above it
    def leads_in(row: str) -> bool:  # a comment, or a declarator line that is not a statement of its own
        return row.lstrip().startswith("//") or (
            re.match(r"\s*(template\s*<|__global__|__device__|static|inline|constexpr)", row) is not None
            and ";" not in row and "}" not in row)

    while head > 0 and lines[head - 1].strip() and leads_in(lines[head - 1]):
        head -= 1
    start = len("\n".join(lines[:head])) + (1 if head else 0)
    return text[start:end].rstrip("\n") + "\n"
