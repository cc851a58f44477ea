"""The embedding reference and its error paths, the wiring into the model, and the chat template (CPU)."""
import pytest
import torch
import torch.nn.functional as F

from dsv2_lib.core import tokenizer
from dsv2_lib.engine.llm import resolve_model
from dsv2_lib.model.layers import Embedding
from dsv2_lib.ops.embedding import embedding, embedding_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_reference_is_a_row_gather(dtype, id_dtype):
    w = torch.randn(50, 33).to(dtype)
    ids = torch.tensor([3, 3, 0, 49, 17], dtype=id_dtype)
    out = embedding_reference(ids, w)
    assert out.shape == (5, 33) and out.dtype == dtype
    assert all(torch.equal(out[t], w[int(i)]) for t, i in enumerate(ids))


def test_reference_keeps_the_ids_shape_and_handles_no_tokens():
    w = torch.randn(10, 4)
    assert embedding_reference(torch.tensor([[1, 2, 3], [4, 5, 6]]), w).shape == (2, 3, 4)
    assert embedding_reference(torch.zeros(0, dtype=torch.long), w).shape == (0, 4)


@pytest.mark.parametrize("bad, pos", [(-1, 2), (10, 2), (10**6, 0)])
def test_out_of_range_ids_raise_with_id_and_position(bad, pos):
    w = torch.randn(10, 4)
    ids = torch.tensor([1, 2, 3, 4])
    ids[pos] = bad
    with pytest.raises(ValueError, match=rf"^token id {bad} at position {pos} is outside the vocabulary \[0, 10\)$"):
        embedding_reference(ids, w)


def test_the_first_bad_position_is_reported():
    with pytest.raises(ValueError, match=r"token id 7 at position 1 "):
        embedding_reference(torch.tensor([0, 7, -3, 9]), torch.randn(5, 2))


def test_float_ids_are_refused():
    with pytest.raises(TypeError, match=r"embedding ids: dtype torch.float32"):
        embedding_reference(torch.tensor([1.0]), torch.randn(5, 2))


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.setenv("DSV2_BACKEND", "auto")
    w = torch.randn(8, 3)
    assert torch.equal(embedding(torch.tensor([5, 1]), w, check=False), F.embedding(torch.tensor([5, 1]), w))


def test_embedding_module_calls_the_op():
    m = Embedding(12, 6)
    m.weight.copy_(torch.randn(12, 6))
    ids = torch.tensor([11, 0, 5])
    assert torch.equal(m(ids), m.weight[ids])
    with pytest.raises(ValueError, match=r"token id 12 at position 0 is outside the vocabulary \[0, 12\)"):
        m(torch.tensor([12]))


def test_chat_template_follows_deepseek_v2_chat():
    BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == f"{BOS}User: Hi\n\nAssistant:"
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    assert tokenizer.apply_chat_template(convo) == (
        f"{BOS}Be brief.\n\nUser: 2+2?\n\nAssistant: 4{EOS}User: 3+3?\n\nAssistant:")
    assert tokenizer.apply_chat_template(convo[:3], add_generation_prompt=False) == (
        f"{BOS}Be brief.\n\nUser: 2+2?\n\nAssistant: 4{EOS}")
    with pytest.raises(ValueError, match=r"message 0: role 'tool'"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 0: content must be a string"):
        tokenizer.apply_chat_template([{"role": "user", "content": None}])


def test_chat_prompt_encodes_with_one_bos_on_the_tiny_tokenizer():
    tok = tokenizer.Tokenizer.from_dir(resolve_model("tiny"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "To be, or not"}])
    ids = tok.encode(text, add_special_tokens=False)
    bos = tok.token_to_id(tokenizer.BOS)
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
