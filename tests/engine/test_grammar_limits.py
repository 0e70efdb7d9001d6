"""Structured outputs as untrusted input: every limit refuses with a message naming it (and never echoing the
input), large valid inputs are served, an empty language is refused, the engine's grammar cache is bounded in
bytes, and the server's worker-process checker survives what crashes or stalls the grammar engine."""
import asyncio
import json

import pytest

from conftest import char_tokenizer
from loramux.config import GrammarLimits
from loramux.engine import grammar
from loramux.engine.grammar import GrammarCompiler
from loramux.sampling_params import StructuredOutputsParams as SO


def chain(rules: int) -> str:
    """A chain of rules (r0 -> r1 -> ...): llguidance recurses along it and overflows its stack at ~2,900."""
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} | "q{i}"' for i in range(rules)) + f'\nr{rules}: "end"'


REFUSED = [
    (SO(grammar=chain(3000)), "3002 rules; at most 1000 (--max-grammar-rules)"),
    (SO(grammar="root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} | "q"' for i in range(5000)) + '\nr5000 ::= "e"'),
     "rules; at most 1000"),
    (SO(grammar="start: " + " | ".join(f'"a{i}"' for i in range(30000))), "30000 alternatives; at most 2000"),
    (SO(grammar="\n".join(f'r{i}: "x"' for i in range(20000)) + "\nstart: r0"), "20001 rules"),
    (SO(regex="a" * 900_000), "900000 bytes; at most 524288 (--max-grammar-bytes)"),
    (SO(choice=[f"c{i}" for i in range(20_000)]), "20000 items; at most 10000 (--max-grammar-choices)"),
    (SO(json='{"type": "array", "items": ' * 100 + "{}" + "}" * 100), "nests deeper than 64 levels"),
    (SO(json="[" * 100_000 + "]" * 100_000), "not valid JSON"),
    (SO(regex="(" * 5000 + "a" + ")" * 5000), "invalid structured output (regex)"),
]


@pytest.mark.parametrize("spec, words", REFUSED, ids=range(len(REFUSED)))
def test_past_a_limit_is_a_value_error_naming_it_and_never_echoing_the_input(spec, words):
    with pytest.raises(ValueError, match=".") as error:
        grammar.check(spec)
    assert words in str(error.value) and len(str(error.value)) <= 400


def test_the_limits_can_be_raised():
    many = SO(choice=[f"c{i}" for i in range(20_000)])
    assert grammar.check(many, GrammarLimits(max_choices=20_000))


@pytest.fixture(scope="module")
def compiler():
    tokenizer = char_tokenizer()
    return GrammarCompiler(tokenizer.backend_tokenizer, 128, [2], GrammarLimits(cache_bytes=40_000))


def walk(matcher, text: str, tokenizer) -> bool:
    """Feed `text` to the matcher token by token; whether it accepts it whole."""
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.compute_bitmask()
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_a_catalogue_of_3000_choices_that_share_prefixes_is_served(compiler):
    """One alternative per choice in a parser row fails past llguidance's 2,000 items once a common prefix is
    read; the choices are one terminal instead, matched by the lexer."""
    choices = [f"item {i}" for i in range(3000)]
    matcher = compiler.submit(SO(choice=choices)).result()
    assert walk(matcher, "item 2345", char_tokenizer()) and not matcher.is_error()


@pytest.mark.parametrize("spec", [SO(json='{"$ref": "#"}'), SO(grammar='start: a\na: a "x"'),
                                  SO(json=json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                                      "$ref": "#/$defs/a"}))])
def test_an_empty_language_is_refused_when_it_compiles(compiler, spec):
    with pytest.raises(ValueError, match="allows no output at all"):
        compiler.submit(spec).result()


def test_the_grammar_cache_is_bounded_in_bytes_of_grammar_text(compiler):
    specs = [SO(choice=[f"{k}-{i}" for i in range(1000)]) for k in range(6)]  # ~9-10 KB of grammar text each
    for spec in specs:
        compiler.submit(spec).result()
    assert 0 < compiler.cached_bytes <= 40_000 and len(compiler._cache) < len(specs)


# ---- the server's checker: worker processes with a time and memory limit ------------------------------------
@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    char_tokenizer().save_pretrained(str(path))
    return str(path / "tokenizer.json")


def run_checks(tokenizer_file, limits: GrammarLimits, specs: list) -> tuple[list, int]:
    """Each spec's verdict (None: accepted, else the 400's message) and how many workers were replaced."""
    from loramux.server.http.grammar_checker import GrammarChecker, GrammarSource

    async def main():
        with open(tokenizer_file, encoding="utf-8") as f:
            checker = GrammarChecker(GrammarSource(f.read(), 128, (2,)), limits)
        verdicts = []
        for spec in specs:
            try:
                await checker.check(spec)
                verdicts.append(None)
            except ValueError as e:
                verdicts.append(str(e))
        checker.close()
        return verdicts, checker.replaced

    return asyncio.run(main())


def test_a_check_that_crashes_the_grammar_engine_is_a_400_and_the_next_check_works(tokenizer_file):
    """With the rule limit raised past what llguidance survives, its stack overflows: the worker dies, not the
    server; the request gets a 400 and a new worker takes the next one."""
    verdicts, replaced = run_checks(tokenizer_file, GrammarLimits(max_rules=100_000),
                                    [SO(choice=["yes", "no"]), SO(grammar=chain(5000)), SO(regex="[a-z]+")])
    assert verdicts[0] is None and verdicts[2] is None and replaced == 1
    assert "crashed the checker" in verdicts[1] and "(it is refused)" in verdicts[1]


def test_a_check_past_its_time_is_a_400_and_the_worker_is_replaced(tokenizer_file):
    verdicts, replaced = run_checks(tokenizer_file, GrammarLimits(check_timeout_s=0.001, max_choices=50_000),
                                    [SO(choice=[f"item {i}" for i in range(40_000)])])
    assert "took longer than 0.001 s (--grammar-check-timeout)" in verdicts[0] and replaced == 1


def test_the_checker_refuses_what_the_engine_would_and_caches_verdicts(tokenizer_file):
    specs = [SO(json='{"$ref": "#"}'), SO(grammar=chain(3000)), SO(json='{"$ref": "#"}')]
    verdicts, replaced = run_checks(tokenizer_file, GrammarLimits(), specs)
    assert "allows no output" in verdicts[0] and "at most 1000" in verdicts[1] and verdicts[2] == verdicts[0]
    assert replaced == 0


def test_a_gbnf_grammar_past_the_rule_limit_is_refused_before_its_conversion(monkeypatch):
    """GBNF -> Lark takes time quadratic in the rules (5,000: ~11 s of a worker): counted first, on the text."""
    import llguidance.gbnf_to_lark

    def never(_):
        raise RuntimeError("converted")

    monkeypatch.setattr(llguidance.gbnf_to_lark, "any_to_lark", never)
    many = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} | "q"' for i in range(1500)) + '\nr1500 ::= "e"'
    with pytest.raises(ValueError, match="1502 rules; at most 1000"):
        grammar.check(SO(grammar=many))
    quoted = 'root ::= "x" r1\n' + "\n".join(f'r{i} ::= "r{i} ::= [a-z] ::= " | [:=]' for i in range(1, 800))
    with pytest.raises(ValueError, match="could not be read: converted"):  # ::= in strings and classes is no rule
        grammar.check(SO(grammar=quoted))
