"""show_source / show_kernel: the plain text is the exact source, the HTML is highlighted."""
import functools
import inspect

import pytest

import dsv2_lib.roofline
from dsv2_lib import show
from dsv2_lib.show import Listing, show_kernel, show_source


def _mime(obj):
    """What Jupyter would send for ``obj``: {mime type: data}."""
    formatters = pytest.importorskip("IPython.core.formatters")
    data, _ = formatters.DisplayFormatter().format(obj)
    return data


def test_show_source_plain_text_is_exact_source():
    fn = dsv2_lib.roofline.expected_distinct_experts
    listing = show_source(fn)
    assert listing.text == inspect.getsource(fn)
    assert repr(listing) == str(listing) == listing.text
    assert _mime(listing)["text/plain"] == inspect.getsource(fn)


def test_show_source_html_is_highlighted_and_labelled():
    listing = show_source(dsv2_lib.roofline.expected_distinct_experts)
    page = _mime(listing)["text/html"]
    assert "dsv2_lib/roofline.py · expected_distinct_experts" in page
    assert "<span style=" in page  # Pygments inline styles: no stylesheet needed
    assert "expected_distinct_experts" in page and "&quot;" not in listing.text


def test_show_source_class_module_and_wrapped():
    assert show_source(Listing).text.startswith("class Listing:")
    assert show_source(dsv2_lib.roofline).origin == "dsv2_lib/roofline.py"

    @functools.lru_cache
    def cached(x):
        return x

    assert show_source(cached).text.lstrip().startswith("@functools.lru_cache")


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
    for bad in ("../setup.py", "sub/a.cu", "a.py", ""):
        with pytest.raises(ValueError):
            show_kernel(bad)


def test_listing_language_checked():
    with pytest.raises(ValueError, match="language"):
        Listing("x", "rust", "x.rs")
