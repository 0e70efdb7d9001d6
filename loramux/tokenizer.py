"""Tokenizer: a model's tokenizer and chat template without transformers' tokenizer classes, which import
torch (the HTTP front end must not).

Encoding and decoding use the `tokenizers` backend that transformers' fast tokenizers wrap; chat templates
are rendered by transformers' own renderer (`render_jinja_template`, torch-free), with the special tokens
as template variables, as `apply_chat_template` does. A directory written by transformers'
`save_pretrained` (tokenizer.json, tokenizer_config.json, chat_template.jinja) is all it reads; the engine
writes one for any model it loads (a GGUF's tokenizer too), so both processes tokenize alike.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tokenizers import Tokenizer as Backend

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, backend: Backend, special_tokens: dict[str, str], chat_template: str | None = None):
        self.backend = backend
        self.special_tokens = dict(special_tokens)  # {"bos_token": "<s>", ...}: chat-template variables
        self.chat_template = chat_template
        self.eos_token_id = self.token_id(special_tokens.get("eos_token"))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path!r} has no tokenizer.json (a fast tokenizer, as save_pretrained writes it)")
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        specials = {k: t for k in _SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        template = config.get("chat_template")
        template_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(Backend.from_file(file), specials, template)

    @classmethod
    def from_pretrained(cls, hf_tokenizer) -> Tokenizer:
        """The same tokenizer from a loaded transformers fast tokenizer (its backend is shared, not copied)."""
        specials = {k: v for k, v in hf_tokenizer.special_tokens_map.items() if k in _SPECIAL_TOKENS}
        return cls(hf_tokenizer.backend_tokenizer, specials, getattr(hf_tokenizer, "chat_template", None))

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat template applied to one conversation, as text (None-valued message keys dropped, as
        transformers does: templates render a missing key better than a None)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send plain prompts instead")
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        rendered, _ = render_jinja_template(conversations=[conversation], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.special_tokens, **kwargs})
        return rendered[0]

    def shows_tools(self) -> bool:
        """Whether the chat template writes the tools it is given into the prompt (rendered with a probe
        tool: a template that ignores `tools` cannot tell the model about them)."""
        probe = "loramux_probe_function_7f3a"
        tool = {"type": "function", "function": {"name": probe, "description": "probe", "parameters": {"type": "object"}}}
        try:
            return probe in self.render_chat([{"role": "user", "content": "hi"}], True, tools=[tool])
        except Exception:  # a template that raises on tools (or has none) does not show them
            return False

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the rendered conversation; the template writes its own special tokens."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def import_renderer() -> None:
    """Import transformers' chat-template renderer ahead of its first use (~0.7 s: transformers' utilities),
    e.g. while the engine starts."""
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}
