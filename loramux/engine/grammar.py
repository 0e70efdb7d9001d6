"""Grammar: structured outputs with llguidance (a maintained grammar engine: JSON schema, regex, choice,
Lark and GBNF grammars, computing each step's allowed-token mask incrementally). No torch: the HTTP front
end checks a request's grammar with the same code before it is queued.

Each constrained request owns a matcher (llguidance.LLMatcher): the engine asks it for the mask of allowed
next tokens before sampling that request's row, and feeds it the sampled token after. Compiling a grammar
(building its matcher) runs on a worker thread, never on the step loop; a compiled grammar is cached by its
text, and each request gets a copy of the cached matcher.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from tokenizers import Tokenizer

from loramux.sampling_params import StructuredOutputsParams

CACHE_SIZE = 64  # compiled grammars kept (by grammar text)
JSON_OBJECT = {"type": "object"}
JSON_OPTIONS = {"whitespace_flexible": False}
"""JSON without optional whitespace (as vLLM's disable_any_whitespace): small models given free whitespace
can emit newlines forever. A schema's own "x-guidance" options override this."""


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a request's structured outputs. ValueError: the spec is not valid
    (the message is llguidance's, naming the place)."""
    if params.json is not None or params.json_object:
        try:
            schema = JSON_OBJECT if params.json_object else json.loads(params.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be a JSON object (or true/false)")
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    elif params.regex is not None:
        grammar = LLMatcher.grammar_from_regex(params.regex)
    elif params.choice is not None:
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    else:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
        except Exception as e:  # the GBNF converter raises plain exceptions on bad input
            raise ValueError(f"the grammar could not be read: {e}") from e
    return grammar


def check(params: StructuredOutputsParams) -> str:
    """grammar_of, then llguidance's validation (no tokenizer needed): ValueError naming the problem."""
    grammar = grammar_of(params)
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"invalid structured output ({_kind(params)}): {problem.strip()}")
    return grammar


def _kind(params: StructuredOutputsParams) -> str:
    return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(params, n))


def grammar_tokenizer(backend: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """llguidance's view of the model's vocabulary: read from the tokenizers JSON when llguidance knows its
    decoder (byte-level BPE, SentencePiece byte fallback: the tokenizers models publish), else built from
    each token decoded alone (any other decoder; exact for tokenizers whose tokens are whole characters)."""
    try:
        return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)
    except Exception:  # "can't determine decoder type"
        return LLTokenizer(TokenizerWrapper(_DecodedVocabulary(backend, eos_token_ids)), n_vocab=vocab_size,
                           eos_token=eos_token_ids)


class _DecodedVocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes (special tokens as 0xFF + their name,
    llguidance's convention), the special ids, and an encoder."""

    def __init__(self, backend: Tokenizer, eos_token_ids: list[int]):
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.tokens, self.special_token_ids = [], []
        for i in range(backend.get_vocab_size(with_added_tokens=True)):
            text = backend.id_to_token(i) or ""
            if text in specials:
                self.special_token_ids.append(i)
                self.tokens.append(b"\xff" + text.encode())
            else:
                self.tokens.append(backend.decode([i], skip_special_tokens=False).encode())
        self.eos_token_id, self.bos_token_id, self._backend = eos_token_ids[0], None, backend

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


class GrammarCompiler:
    """Builds matchers off the step loop. tokenizer_json: the model's tokenizers JSON; vocab_size: the
    logits' width (the model's vocabulary, which may be padded past the tokenizer's)."""

    def __init__(self, backend: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._source = (backend, vocab_size, list(eos_token_ids))
        self._tokenizer: LLTokenizer | None = None  # built at the first compile (~1 s), on the worker thread
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loramux-grammar")

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of a fresh matcher for `params` (its exception: ValueError naming the problem)."""
        return self._executor.submit(self._matcher, params)

    def _matcher(self, params: StructuredOutputsParams) -> LLMatcher:
        grammar = check(params)
        cached = self._cache.get(grammar)
        if cached is None:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(*self._source)
            cached = LLMatcher(self._tokenizer, grammar, log_level=0)
            if cached.is_error():
                raise ValueError(f"invalid structured output ({_kind(params)}): {cached.get_error()}")
            self._cache[grammar] = cached
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(grammar)
        return cached.deep_copy()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
