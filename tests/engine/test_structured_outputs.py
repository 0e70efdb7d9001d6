"""Structured outputs (llguidance) in mixed-adapter batches: each constrained row's greedy tokens equal the
oracle's — PEFT's logits for that adapter alone, masked by the grammar, argmax — and unconstrained rows are
untouched by their constrained batch mates. Grammars compile off the step loop."""
import json
import re
import threading
import time

import pytest
import torch

from conftest import peft_logits
from loramux.engine.grammar import GrammarCompiler
from loramux.layers.sampler import allowed_tokens
from loramux.sampling_params import SamplingParams, StructuredOutputsParams as SO
from test_llm import checkpoints, make_llm, prompts  # noqa: F401  (the module fixture)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "pattern": "^[a-c]{2}$"}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
SPECS = {
    "json": SO(json=json.dumps(SCHEMA)),
    "regex": SO(regex=r"[0-9]{3}-[a-z]{2}"),
    "choice": SO(choice=("yes", "no", "maybe")),
    "json_object": SO(json_object=True),
    "gbnf": SO(grammar='root ::= "a" ("b" | "c") ("b" | "c")? "d"'),
    "lark": SO(grammar='start: "x" /[0-9]{1,3}/ "y"'),
}


def follows(kind: str, text: str, finish_reason: str) -> bool:
    """The output follows the grammar. A random tiny model may write JSON keys until max_tokens: an unfinished
    json_object is checked as a prefix."""
    if kind == "json_object" and finish_reason == "length":
        return text.startswith("{")
    if finish_reason != "stop":
        return False
    if kind == "json":
        value = json.loads(text)
        return (set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
                and re.fullmatch("[a-c]{2}", value["tag"]) is not None)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    pattern = {"regex": r"[0-9]{3}-[a-z]{2}", "choice": "yes|no|maybe", "gbnf": "a[bc]{1,2}d", "lark": "x[0-9]{1,3}y"}[kind]
    return re.fullmatch(pattern, text) is not None


def oracle(base, adapter_dir, prompt, spec, compiler, max_tokens, eos=2):
    """Greedy over PEFT's logits for that adapter alone, each step masked by a fresh matcher of the grammar."""
    matcher, ids = compiler.submit(spec).result(), list(prompt)
    for _ in range(max_tokens):
        logits = peft_logits(base, adapter_dir, torch.tensor([ids]))[0, -1].float()
        logits[~allowed_tokens(matcher.compute_bitmask(), logits.shape[0])] = float("-inf")
        token = int(logits.argmax())
        assert matcher.consume_token(token)
        ids.append(token)
        if token == eos:
            break
    return ids[len(prompt):]


def test_constrained_rows_equal_the_masked_oracle_and_free_rows_are_untouched(checkpoints):  # noqa: F811
    base, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters, max_model_len=64)
    compiler = GrammarCompiler(llm.engine.core.hf_tokenizer.backend_tokenizer, llm.engine.core.limits.vocab_size, [2])
    kinds = list(SPECS)
    rows = ["r4", None, "r8_rslora", "r64_qv", "r4", None]
    batch = prompts(len(kinds), seed=11)
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=SPECS[k]) for k in kinds]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(batch + batch[:3], params + [free] * 3, adapters=rows + rows[:3])
    for kind, prompt, adapter, out in zip(kinds, batch, rows, outs):
        assert follows(kind, out.text, out.finish_reason), (kind, out.text)
        assert out.token_ids == oracle(base, adapters.get(adapter), prompt, SPECS[kind], compiler, 40), kind
    alone = llm.generate(batch[:3], free, adapters=rows[:3])
    assert [o.token_ids for o in outs[len(kinds):]] == [o.token_ids for o in alone]


def test_sampled_rows_follow_the_grammar_too(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters, max_model_len=64)
    for kind, spec in SPECS.items():
        params = [SamplingParams(max_tokens=40, temperature=1.3, seed=s, structured_outputs=spec) for s in range(4)]
        for out in llm.generate(prompts(4, seed=2), params, adapters=["r4", None, "r64_qv", "r8_rslora"]):
            assert follows(kind, out.text, out.finish_reason), (kind, out.text)


@pytest.mark.parametrize("spec, words", [
    (SO(json="{not json"), "not valid JSON"),
    (SO(json='{"type": "bogus"}'), "Invalid type"),
    (SO(regex="a(b"), "unclosed group"),
    (SO(grammar="root ::= missing"), "missing"),
])
def test_an_invalid_spec_is_refused_when_added(checkpoints, spec, words):  # noqa: F811
    _, path, _ = checkpoints["llama"]
    llm = make_llm(path)
    with pytest.raises(ValueError, match=words):
        llm.engine.add_request([5, 6], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs", [{}, {"json": "{}", "regex": "a"}, {"choice": []}, {"regex": 5}])
def test_structured_outputs_params_need_exactly_one_well_typed_constraint(kwargs):
    with pytest.raises(ValueError, match="structured outputs"):
        SO(**kwargs)


def test_grammars_compile_off_the_step_loop_and_are_cached(checkpoints, monkeypatch):  # noqa: F811
    """A slow compile holds back only its own request; the same grammar twice is compiled once."""
    _, path, _ = checkpoints["llama"]
    llm = make_llm(path, max_model_len=64)
    core, release, built = llm.engine.core, threading.Event(), []
    real = GrammarCompiler._matcher

    def slow(self, params):
        release.wait(120)
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "_matcher", slow)
    constrained = SamplingParams(max_tokens=8, temperature=0, structured_outputs=SPECS["regex"])
    core.add_request("slow", [5, 6, 7], constrained)
    core.add_request("free", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    done = {}
    while "free" not in done:
        done.update({o.request_id: o for o in core.step() if o.finished})
    assert "slow" not in done and core.has_unfinished_requests()  # the free request finished meanwhile
    release.set()
    start = time.monotonic()
    while core.has_unfinished_requests():
        done.update({o.request_id: o for o in core.step() if o.finished})
    assert done["slow"].finish_reason == "stop" and time.monotonic() - start < 120  # does not hang
    monkeypatch.setattr(GrammarCompiler, "_matcher", real)
    before = len(core.grammars._cache)
    llm.generate([[5], [6]], constrained)
    assert len(core.grammars._cache) == before  # the regex was compiled once, for the first request


def test_aborting_a_request_whose_grammar_is_compiling(checkpoints, monkeypatch):  # noqa: F811
    _, path, _ = checkpoints["llama"]
    llm = make_llm(path, max_model_len=64)
    release = threading.Event()
    monkeypatch.setattr(GrammarCompiler, "_matcher", lambda self, params: release.wait(120))
    core = llm.engine.core
    core.add_request("a", [5, 6], SamplingParams(structured_outputs=SPECS["choice"]))
    assert core.abort_request("a") and not core.has_unfinished_requests()
    release.set()
    assert core.step() == []


def test_an_adapter_unloaded_while_the_grammar_compiles_ends_the_request_not_the_engine(checkpoints, monkeypatch):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"r4": adapters["r4"]}, max_model_len=64)
    core, release, real = llm.engine.core, threading.Event(), GrammarCompiler._matcher

    def slow(self, params):
        release.wait(120)
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "_matcher", slow)
    core.add_request("a", [5, 6], SamplingParams(structured_outputs=SPECS["choice"]), adapter="r4")
    assert core.adapters.unload_adapter("r4")  # nothing holds it yet: the request is not queued until compiled
    release.set()
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert [(o.finish_reason, "unloaded" in o.error, o.status) for o in outs] == [("error", True, 404)]
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # still serving
