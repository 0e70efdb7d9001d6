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
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper
from tokenizers import Tokenizer

from loramux.config import GrammarLimits
from loramux.sampling_params import StructuredOutputsParams

JSON_OBJECT = {"type": "object"}
JSON_OPTIONS = {"whitespace_flexible": False}
"""JSON without optional whitespace (as vLLM's disable_any_whitespace): small models given free whitespace
can emit newlines forever. A schema's own "x-guidance" options override this."""
MAX_ERROR_CHARS = 300  # the grammar engine's messages quote the input: never echo it wholesale


def parser_limits() -> LLParserLimits:
    """llguidance's own limits (its defaults), with errors that never carry the parser state or the grammar."""
    return LLParserLimits(verbose_errors=False)


def grammar_of(params: StructuredOutputsParams, limits: GrammarLimits = GrammarLimits()) -> str:
    """The llguidance grammar for a request's structured outputs. ValueError: the spec is not valid or is
    past a limit (the message names the place or the limit)."""
    _check_size(params, limits)
    if params.json is not None or params.json_object:
        return LLMatcher.grammar_from_json_schema(_schema(params, limits), defaults=JSON_OPTIONS)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        if len(params.choice) > limits.max_choices:
            raise ValueError(f"the structured output's choice list has {len(params.choice)} items; at most "
                             f"{limits.max_choices} (--max-grammar-choices)")
        # one terminal: the lexer matches the list, so no parser row holds every choice (llguidance's row limit)
        return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
    from llguidance.gbnf_to_lark import any_to_lark

    _count_rules(_GBNF_RULE.findall(_GBNF_LITERALS.sub('""', params.grammar)), limits)  # before a conversion
    try:  # that takes time quadratic in the rules (5,000: ~11 s)
        lark = any_to_lark(params.grammar)
    except Exception as e:  # the GBNF converter raises plain exceptions on bad input
        raise ValueError(f"the grammar could not be read: {_short(str(e))}") from e
    _check_lark(lark, limits)
    return LLMatcher.grammar_from_lark(lark)


def _check_size(params: StructuredOutputsParams, limits: GrammarLimits) -> None:
    text = params.json or params.regex or params.grammar or ""
    size = len(text.encode("utf-8", "surrogatepass")) + sum(len(c.encode("utf-8", "surrogatepass")) + 1
                                                            for c in params.choice or ())
    if size > limits.max_bytes:
        raise ValueError(f"the structured output's {_kind(params)} is {size} bytes; at most {limits.max_bytes} "
                         "(--max-grammar-bytes)")


def _schema(params: StructuredOutputsParams, limits: GrammarLimits):
    if params.json_object:
        return JSON_OBJECT
    try:
        schema = json.loads(params.json)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"the JSON schema is not valid JSON: {_short(str(e))}") from e
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be a JSON object (or true/false)")
    if _depth(schema) > limits.max_nesting:
        raise ValueError(f"the JSON schema nests deeper than {limits.max_nesting} levels (--max-grammar-nesting)")
    return schema


def _depth(value) -> int:
    """How deep JSON objects and arrays nest in `value` (iterative: no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


_LARK_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*')  # strings and regexes
_LARK_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:", re.MULTILINE)


_GBNF_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]')  # strings and character classes
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][A-Za-z0-9_-]*\s*::=", re.MULTILINE)


def _count_rules(heads: list, limits: GrammarLimits) -> None:
    if len(heads) > limits.max_rules:
        raise ValueError(f"the grammar has {len(heads)} rules; at most {limits.max_rules} (--max-grammar-rules)")


def _check_lark(lark: str, limits: GrammarLimits) -> None:
    """Rules and alternatives per rule within the limits: the grammar engine recurses along chains of rules
    (thousands crash it) and caps a parser row at 2,000 items. Literals are blanked out before counting."""
    text = _LARK_LITERALS.sub('""', lark)
    heads = list(_LARK_RULE.finditer(text))
    _count_rules(heads, limits)
    for head, nxt in zip(heads, [*heads[1:], None]):
        name = head.group(1)
        if name.isupper():  # a terminal: the lexer matches its alternatives, the parser sees one token
            continue
        alternatives = text.count("|", head.end(), nxt.start() if nxt else len(text)) + 1
        if alternatives > limits.max_alternatives:
            raise ValueError(f"the grammar's rule {name!r} has {alternatives} alternatives; at most "
                             f"{limits.max_alternatives} (--max-grammar-alternatives; literals can go in a terminal "
                             "instead: NAME: \"a\" | \"b\")")


def check(params: StructuredOutputsParams, limits: GrammarLimits = GrammarLimits()) -> str:
    """grammar_of, then llguidance's validation (no tokenizer needed): the grammar, or ValueError naming the
    problem."""
    grammar = grammar_of(params, limits)
    problem = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if problem:
        raise ValueError(f"invalid structured output ({_kind(params)}): {_short(problem.strip())}")
    return grammar


def compile_matcher(tokenizer: LLTokenizer, grammar: str, kind: str) -> LLMatcher:
    """A matcher for a checked grammar; ValueError if the grammar engine refuses it, or if it allows no output
    at all (an empty language: a $ref cycle, a rule that never ends; the first mask finds it)."""
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise ValueError(f"invalid structured output ({kind}): {_short(matcher.get_error())}")
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise ValueError(f"the structured output ({kind}) allows no output at all (its language is empty: a rule or "
                         f"$ref that can never end?): {_short(probe.get_error())}")
    return matcher


def _kind(params: StructuredOutputsParams) -> str:
    return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(params, n))


def kind_of(params: StructuredOutputsParams) -> str:
    """Which of json, regex, choice, grammar or json_object the request set (for messages)."""
    return _kind(params)


def _short(message: str) -> str:
    message = " ".join(message.replace("<non-verbose/>", "").split())
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS - 3] + "..."


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
    """Builds matchers off the step loop. backend: the model's tokenizer; vocab_size: the logits' width (the
    model's vocabulary, which may be padded past the tokenizer's). Compiled grammars are cached by grammar
    text, least recently used out first, up to limits.cache_bytes of text."""

    def __init__(self, backend: Tokenizer, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits = GrammarLimits()):
        self._source = (backend, vocab_size, list(eos_token_ids))
        self.limits = limits
        self._tokenizer: LLTokenizer | None = None  # built at the first compile (~1 s), on the worker thread
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._cache_bytes = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loramux-grammar")

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of a fresh matcher for `params` (its exception: ValueError naming the problem)."""
        return self._executor.submit(self._matcher, params)

    def _matcher(self, params: StructuredOutputsParams) -> LLMatcher:
        grammar = check(params, self.limits)
        cached = self._cache.get(grammar)
        if cached is None:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(*self._source)
            cached = compile_matcher(self._tokenizer, grammar, _kind(params))
            self._remember(grammar, cached)
        self._cache.move_to_end(grammar)
        return cached.deep_copy()

    def _remember(self, grammar: str, matcher: LLMatcher) -> None:
        self._cache[grammar] = matcher
        self._cache_bytes += len(grammar)
        while self._cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
            old, _ = self._cache.popitem(last=False)
            self._cache_bytes -= len(old)

    @property
    def cached_bytes(self) -> int:
        """Bytes of grammar text behind the cached matchers."""
        return self._cache_bytes

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
