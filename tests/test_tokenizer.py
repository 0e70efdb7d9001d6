"""loramux.tokenizer.Tokenizer (torch-free, for the HTTP process) against transformers' tokenizer on the same
files: the same ids, the same text, the same chat prompts."""
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from conftest import char_tokenizer
from loramux.tokenizer import Tokenizer

CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
TEXTS = ["Hello world", " leading space", "Héllo wörld 🙂 ok", "<|im_end|> special in text", "a\n\nb  c\t", "", "x" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "hi there"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"},
     {"role": "assistant", "content": "because"}, {"role": "user", "content": "ok 🙂"}],
]


@pytest.fixture(scope="module", params=["smollm2", "char"])
def pair(request, tmp_path_factory):
    """(transformers tokenizer, ours from the directory it saved)."""
    if request.param == "smollm2":
        from loramux.models.loader import default_model_path

        hf = AutoTokenizer.from_pretrained(default_model_path())
    else:
        hf = char_tokenizer()
        hf.chat_template = CHAT
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(path))
    return hf, Tokenizer.from_dir(str(path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(pair, text):
    hf, ours = pair
    ids = hf.encode(text)
    assert ours.encode(text) == ids and Tokenizer.from_pretrained(hf).encode(text) == ids
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_equals_transformers(pair, conversation, generation_prompt):
    hf, ours = pair
    expected = hf.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=True,
                                      return_dict=False)
    assert ours.apply_chat_template(conversation, generation_prompt) == list(expected)


def test_special_ids_and_sizes(pair):
    hf, ours = pair
    assert ours.eos_token_id == hf.eos_token_id and ours.vocab_size == len(hf)


def test_no_chat_template_is_a_clear_error():
    ours = Tokenizer.from_pretrained(char_tokenizer())
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])


def test_importing_it_does_not_import_torch():
    code = "import sys, loramux.tokenizer, loramux.server.http.app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
