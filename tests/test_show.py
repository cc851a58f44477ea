"""show_source / show_kernel: the plain text is the exact source, the HTML is highlighted."""
import functools
import inspect

import pytest

import dsv2_lib.tools.roofline
from dsv2_lib.tools import show
from dsv2_lib.tools.show import Listing, show_kernel, show_source


def _mime(obj):
    """What Jupyter would send for ``obj``: {mime type: data}."""
    formatters = pytest.importorskip("IPython.core.formatters")
    data, _ = formatters.DisplayFormatter().format(obj)
    return data


def test_show_source_plain_text_is_exact_source():
    fn = dsv2_lib.tools.roofline.expected_distinct_experts
    listing = show_source(fn)
    assert listing.text == inspect.getsource(fn)
    assert repr(listing) == str(listing) == listing.text
    assert _mime(listing)["text/plain"] == inspect.getsource(fn)


def test_show_source_html_is_highlighted_and_labelled():
    listing = show_source(dsv2_lib.tools.roofline.expected_distinct_experts)
    page = _mime(listing)["text/html"]
    assert "dsv2_lib/tools/roofline.py · expected_distinct_experts" in page
    assert "<span style=" in page  # Pygments inline styles: no stylesheet needed
    assert "expected_distinct_experts" in page and "&quot;" not in listing.text


def test_show_source_class_module_and_wrapped():
    assert show_source(Listing).text.startswith("class Listing:")
    assert show_source(dsv2_lib.tools.roofline).origin == "dsv2_lib/tools/roofline.py"

    @functools.lru_cache
    def cached(x):
        return x

    assert show_source(cached).text.lstrip().startswith("@functools.lru_cache")


def test_show_source_lines_cut_a_stretch():
    """``lines`` keeps the lines from the first marker up to (not including) the next stop marker."""
    fn = dsv2_lib.tools.roofline.expected_distinct_experts
    rows = inspect.getsource(fn).splitlines(keepends=True)
    body = show_source(fn, lines=('"""', None)).text  # from the docstring's first line to the end
    assert body == "".join(rows[1:]) and body.startswith(rows[1])
    one = show_source(fn, lines=("def expected_distinct_experts", '"""')).text
    assert one == rows[0]
    with pytest.raises(KeyError, match="roofline.py · expected_distinct_experts has no line with 'nowhere'"):
        show_source(fn, lines=("nowhere", None))


def test_show_source_rejects_builtins():
    with pytest.raises(TypeError, match="no Python source"):
        show_source(len)


def test_show_kernel(tmp_path, monkeypatch):
    src = '#include <cuda_bf16.h>\n__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }  // "<&>"\n'
    (tmp_path / "double.cu").write_text(src)
    monkeypatch.setattr(show, "KERNEL_DIR", tmp_path)
    listing = show_kernel("double.cu")
    mime = _mime(listing)
    assert mime["text/plain"] == src
    assert "kernels_cu/double.cu" in mime["text/html"]
    assert "&lt;&amp;&gt;" in mime["text/html"]  # escaped, not injected
    assert "__global__" in mime["text/html"]


def test_show_kernel_bad_names(tmp_path, monkeypatch):
    (tmp_path / "a.cu").write_text("")
    monkeypatch.setattr(show, "KERNEL_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"available: \['a.cu'\]"):
        show_kernel("missing.cu")
    with pytest.raises(FileNotFoundError, match=r"no 'sub/a.cu'"):
        show_kernel("sub/a.cu")  # a lesson's kernel sits in a folder: a path inside kernels_cu/ is fine
    for bad in ("../setup.py", "sub/../../a.cu", "/abs/a.cu", "a.py", ""):
        with pytest.raises(ValueError):
            show_kernel(bad)


def test_listing_language_checked():
    with pytest.raises(ValueError, match="language"):
        Listing("x", "rust", "x.rs")


EXCERPT_SRC = """\
#include "common.cuh"
namespace k {
constexpr int N = 4;  // { not a brace }
}  // namespace k

__device__ float helper(float x);  // a declaration: no body
template <typename T> __device__ T pick(T a);  // declared first ...
template <> __device__ float pick<float>(float a) { return a; }  // ... defined later: the definition is shown

// Doubles x.
// Two comment lines belong to it.
template <typename T>
__global__ void __launch_bounds__(k::N * 32, f(2)) twice(T* x) {
    const char* s = "}";  // a brace in a string
    if (threadIdx.x < 4) { x[threadIdx.x] *= 2; }
    // ---- phase two
    x[0] += 1;
    // ---- end
}

template <typename T> struct alignas(16) Pair {
    T a, b;
};
"""


def test_show_kernel_excerpts_one_definition(tmp_path, monkeypatch):
    """A part is one definition, its comments and template line included, braces in comments and
    strings not counted; ``lines`` cuts a stretch between two markers; a wrong name lists the names."""
    (tmp_path / "x.cu").write_text(EXCERPT_SRC)
    monkeypatch.setattr(show, "KERNEL_DIR", tmp_path)
    twice = show_kernel("x.cu", "twice")
    assert twice.text == EXCERPT_SRC[EXCERPT_SRC.index("// Doubles"):EXCERPT_SRC.index("\ntemplate <typename T> struct")]
    assert "kernels_cu/x.cu · twice" in _mime(twice)["text/html"]
    assert show_kernel("x.cu", "Pair").text == "template <typename T> struct alignas(16) Pair {\n    T a, b;\n};\n"
    assert show_kernel("x.cu", "pick").text == "template <> __device__ float pick<float>(float a) { return a; }  // ... defined later: the definition is shown\n"
    assert show_kernel("x.cu", "k").text == "namespace k {\nconstexpr int N = 4;  // { not a brace }\n}  // namespace k\n"
    assert show_kernel("x.cu", "twice", lines=("---- phase two", "---- end")).text == \
        "    // ---- phase two\n    x[0] += 1;\n"
    with pytest.raises(KeyError, match=r"no definition 'thrice' in x.cu; top-level names: \['Pair', 'helper', 'k', 'pick', 'twice'\]"):
        show_kernel("x.cu", "thrice")
    with pytest.raises(KeyError, match="declared without a body"):
        show_kernel("x.cu", "helper")
    assert show_kernel("x.cu", "twice", lines=("---- end", None)).text == "    // ---- end\n}\n"
    with pytest.raises(KeyError, match="no line with 'phase three'"):
        show_kernel("x.cu", "twice", lines=("phase three", "end"))
    with pytest.raises(ValueError, match="name the part"):
        show_kernel("x.cu", lines=("a", "b"))
