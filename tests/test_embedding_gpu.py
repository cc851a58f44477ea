"""The embedding kernel against its reference on the GPU (``pytest -m gpu``).

Tolerance: none. A gather copies bits — no arithmetic touches the values — so kernel and
reference must be equal element for element (``torch.equal``) in every dtype.
"""
import os

import pytest
import torch

from dsv2_lib.ops import embedding as emb
from dsv2_lib.ops.embedding import embedding, embedding_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [2048, 576, 33, 1000, 8]
TOKENS = [0, 1, 7, 4096]


def random_ids(T, V):
    """Ids with many repeats: drawn from a pool of min(V, max(1, T // 4)) distinct values."""
    pool = torch.randint(0, V, (min(V, max(1, T // 4)),), device="cuda")
    return pool[torch.randint(0, len(pool), (T,), device="cuda")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("vocab", [37, 102400])
def test_embedding_matches_reference(tokens, hidden, dtype, vocab):
    if vocab * hidden > 2**27 and hidden != 2048:
        vocab = 4096  # keep the large-vocabulary case to the real model's width (memory and time)
    w = torch.randn(vocab, hidden, device="cuda").to(dtype)
    ids = random_ids(tokens, vocab)
    got = embedding(ids, w)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    assert torch.equal(got, embedding_reference(ids, w))


def test_extreme_ids_and_int32_ids():
    w = torch.randn(102400, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([0, 102399, 0, 102399, 5], device="cuda")
    assert torch.equal(embedding(ids, w), w[ids])
    assert torch.equal(embedding(ids.int(), w), w[ids])


def test_ids_keep_their_shape():
    w = torch.randn(100, 64, device="cuda", dtype=torch.float16)
    ids = torch.randint(0, 100, (3, 5), device="cuda")
    assert torch.equal(embedding(ids, w), embedding_reference(ids, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [-1, 1000, -(2**40), 2**40])
@pytest.mark.parametrize("hidden", [2048, 33])
def test_out_of_range_id_raises_and_never_reads(bad, dtype, hidden):
    """The kernel never dereferences weight[bad] (compute-sanitizer runs this file), and reports the first bad position."""
    w = torch.randn(1000, hidden, device="cuda").to(dtype)
    ids = torch.tensor([3, 4, bad, 5, bad], device="cuda")
    msg = rf"^token id {bad} at position 2 is outside the vocabulary \[0, 1000\)$"
    with pytest.raises(ValueError, match=msg):
        embedding(ids, w)
    with pytest.raises(ValueError, match=msg):
        embedding_reference(ids, w)
    # the buffer was reset: the next checked call with good ids passes
    good = torch.tensor([3, 4, 999], device="cuda")
    assert torch.equal(embedding(good, w), w[good])


def test_check_false_leaves_zero_rows_and_does_not_raise():
    w = torch.randn(1000, 576, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([7, -1, 8, 1000, 9], device="cuda")
    out = embedding(ids, w, check=False)
    torch.cuda.synchronize()
    assert torch.equal(out[[0, 2, 4]], w[[7, 8, 9]])
    assert not out[[1, 3]].any()
    with pytest.raises(ValueError, match=r"token id -1 at position 1"):  # stale error state does not leak either way
        embedding(ids, w)


def test_unaligned_weight_view_takes_the_scalar_path():
    """A table view starting one element in is not 16-byte aligned: no vector load may touch it."""
    base = torch.randn(500 * 2048 + 1, device="cuda", dtype=torch.bfloat16)
    w = base[1:].view(500, 2048)
    assert w.data_ptr() % 16 != 0
    ids = random_ids(300, 500)
    assert torch.equal(embedding(ids, w), embedding_reference(ids, w))


def test_strided_rows_are_read_in_place():
    """A column slice (rows 2048 apart, 1024 wide) is gathered without a copy; a transposed table is refused."""
    full = torch.randn(200, 2048, device="cuda", dtype=torch.bfloat16)
    ids = random_ids(50, 200)
    for w in (full[:, :1024], full[:, 8:1032], full[:, 1:1001]):  # vector, vector, scalar (unaligned)
        assert torch.equal(embedding(ids, w), embedding_reference(ids, w))
    with pytest.raises(ValueError, match=r"rows must be contiguous"):
        embedding(ids, full.t())


def test_bad_inputs_are_refused_before_launch():
    w = torch.randn(10, 8, device="cuda")
    with pytest.raises(TypeError, match=r"embedding ids: dtype torch.float32, expected torch.int64"):
        embedding(torch.tensor([1.0], device="cuda"), w)
    with pytest.raises(ValueError, match=r"embedding ids: on cpu"):
        embedding(torch.tensor([1]), w)
    with pytest.raises(ValueError, match=r"embedding weight: shape \[80\], expected \[\*, \*\]"):
        embedding(torch.tensor([1], device="cuda"), w.view(80))
    with pytest.raises(TypeError, match=r"has no kernel"):
        embedding(torch.tensor([1], device="cuda"), w.double())


def test_zero_tokens_and_zero_width():
    w = torch.randn(10, 0, device="cuda")
    assert embedding(torch.tensor([1, 2], device="cuda"), w).shape == (2, 0)
    with pytest.raises(ValueError, match=r"token id 10 at position 1"):
        embedding(torch.tensor([1, 10], device="cuda"), w)
    assert embedding(torch.zeros(0, dtype=torch.long, device="cuda"), torch.randn(10, 8, device="cuda")).shape == (0, 8)


@pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                    reason="capture allocates through PyTorch's caching allocator, which the sanitizer runs switch off")
@pytest.mark.cuda_graph
def test_cuda_graph_capture_and_replay_on_new_ids():
    """check=False captures (no host sync); check=True inside a capture is refused with a clear error."""
    w = torch.randn(102400, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 102400, (64,), device="cuda")
    embedding(ids, w, check=False)  # compile and allocate the error buffer outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embedding(ids, w, check=False)
    for _ in range(3):
        ids.copy_(torch.randint(0, 102400, (64,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w[ids])
    with pytest.raises(RuntimeError, match=r"pass check=False inside the graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            embedding(ids, w)
    assert torch.equal(embedding(ids, w), w[ids])  # and the op still works after the refused capture


def test_error_buffer_is_one_per_device():
    w = torch.randn(10, 8, device="cuda")
    embedding(torch.tensor([1], device="cuda"), w)
    embedding(torch.tensor([2], device="cuda"), w)
    assert len(emb._bad_pos) == 1 and emb._bad_pos[torch.cuda.current_device()].numel() == 1
