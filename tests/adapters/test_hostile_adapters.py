"""The hostile-adapter corpus through the Python API: every case is refused with a message naming its cause,
no code in a pickle runs, and the adapters already loaded answer byte for byte as before."""
import os

import pytest

from conftest import save_checkpoint, save_peft_adapter, tiny_llama
from support.hostile_adapters import BAD_NAMES, build_corpus
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.llm import LLM

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    base = tiny_llama()
    good = save_peft_adapter(base, root / "good", r=8, target_modules=ATTENTION)
    cases = build_corpus(good, str(root / "allowed"), str(root / "outside"))
    llm = LLM(model=save_checkpoint(base, root / "model"), lora=LoRAConfig(max_loras=2, max_lora_rank=32),
              dtype="float32", kv_cache_memory=2**23, max_model_len=64)
    for i, name in enumerate(["ok1", "ok2"]):
        assert llm.load_adapter(name, save_peft_adapter(base, root / name, seed=50 + i, r=4 * (i + 1)))
    return llm, cases, root


def answers(llm):
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    return [o.token_ids for a in ("ok1", "ok2", None) for o in llm.generate(prompts, GREEDY, adapters=a)]


def test_the_corpus_is_large_and_varied(setup):
    _, cases, _ = setup
    assert len(cases) >= 40 and len({c.id for c in cases}) == len(cases)


def test_every_case_is_refused_with_its_cause_and_nothing_changes(setup):
    llm, cases, root = setup
    before = answers(llm)
    allowed = str(root / "allowed")
    for case in cases:
        for allow_pickle in (False, True):  # pickles: refused, then read weights_only (their __reduce__ refused)
            result = llm.load_adapter(f"bad-{case.id}", case.path, allow_pickle=allow_pickle, allowed_dirs=(allowed,))
            assert result != LoRAStatus.SUCCESS, case.id
            if not allow_pickle:
                assert case.words in result.message, (case.id, result.message)
    assert not os.path.exists(root / "outside" / "pwned")  # the pickle's code never ran
    assert llm.loras == ["ok1", "ok2"] and answers(llm) == before


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused(setup, name):
    llm, _, root = setup
    result = llm.load_adapter(name, str(root / "good"))
    assert result == LoRAStatus.LOAD_INVALID_NAME and "adapter name" in result.message
