"""The DeepSeek-V2-Chat prompt format (``tokenizer.apply_chat_template``)."""
import pytest

from dsv2_lib import LLM
from dsv2_lib.core.tokenizer import BOS, EOS, apply_chat_template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


def test_conversation_renders_as_deepseek_v2_chat_was_trained():
    want = f"{BOS}Be brief.\n\nUser: Hi\n\nAssistant: Hello!{EOS}User: 2+2?\n\nAssistant:"
    assert apply_chat_template(CONVERSATION) == want
    assert apply_chat_template(CONVERSATION, add_generation_prompt=False) == want.removesuffix("Assistant:")


def test_rendered_prompt_encodes_with_exactly_one_bos():
    tok = LLM("tiny", device="cpu").tokenizer
    ids = tok.encode(apply_chat_template(CONVERSATION[1:2]), add_special_tokens=False)
    assert ids[0] == tok.token_to_id(BOS) and ids.count(tok.token_to_id(BOS)) == 1
    assert tok.token_to_id(EOS) not in ids


@pytest.mark.parametrize("message, error", [
    ({"role": "tool", "content": "x"}, r"message 0: role 'tool'; expected 'system', 'user' or 'assistant'"),
    ({"role": "user"}, r"message 0: content must be a string, got NoneType"),
    ({"role": "user", "content": 3}, r"message 0: content must be a string, got int"),
])
def test_bad_messages_are_refused_with_their_index(message, error):
    with pytest.raises(ValueError, match=error):
        apply_chat_template([message])
