"""Adapters pushed from memory (LLM.load_adapter_from_tensors), as a trainer holds them: the same tokens and logits
as the same adapter read from files; refused exactly as the same content in files is; replace=True puts new
weights under the name while requests already running finish on the old ones."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.llm import LLM

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
PROMPTS = [[5, 9, 14, 3], [7, 7, 21, 40, 2]]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    base = tiny_llama()
    llm = LLM(model=save_checkpoint(base, root / "model"), lora=LoRAConfig(max_loras=2, max_lora_rank=16),
              dtype="float32", kv_cache_memory=2**23, max_model_len=64)
    return base, llm, root


def files_of(path) -> tuple[dict, dict]:
    with open(f"{path}/adapter_config.json") as f:
        return load_file(f"{path}/adapter_model.safetensors"), json.load(f)


def run(llm, adapter):
    return llm.generate(PROMPTS, GREEDY, adapters=adapter)


def test_a_pushed_adapter_answers_as_the_same_files_do(setup):
    base, llm, root = setup
    path = save_peft_adapter(base, root / "a", seed=1, r=8)
    assert llm.load_adapter("from-files", path)
    tensors, config = files_of(path)
    assert llm.load_adapter_from_tensors("pushed", tensors, config)
    for f, p, prompt in zip(run(llm, "from-files"), run(llm, "pushed"), PROMPTS):
        assert p.token_ids == f.token_ids == hf_greedy(base, path, prompt, GREEDY.max_tokens)
        assert p.logprobs.logprobs == f.logprobs.logprobs and p.logprobs.top_ids == f.logprobs.top_ids
    for t in tensors.values():
        t.mul_(3)  # the trainer's next update, in its own tensors: the pushed copy does not change
    assert [o.token_ids for o in run(llm, "pushed")] == [o.token_ids for o in run(llm, "from-files")]


def test_a_trainers_peft_model_is_pushed_from_its_state_dict(setup):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base, llm, root = setup
    torch.manual_seed(4)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION,
                                                           init_lora_weights=False))
    result = llm.load_adapter_from_tensors("trained", get_peft_model_state_dict(model),
                                           model.peft_config["default"].to_dict())
    assert result, result.message
    model.save_pretrained(str(root / "trained"))
    for out, prompt in zip(run(llm, "trained"), PROMPTS):
        assert out.token_ids == hf_greedy(base, str(root / "trained"), prompt, GREEDY.max_tokens)


def test_replace_serves_new_weights_and_running_requests_finish_on_the_old(setup):
    base, llm, root = setup
    v1, v2 = (save_peft_adapter(base, root / f"v{i}", seed=10 + i, r=8) for i in (1, 2))
    assert llm.load_adapter_from_tensors("live", *files_of(v1))
    revision = run(llm, "live")[0].revision  # which load answered: name@rev
    assert revision.startswith("live@") and run(llm, None)[0].revision is None
    refused = llm.load_adapter_from_tensors("live", *files_of(v2))
    assert refused == LoRAStatus.LOAD_NAME_EXISTS and "replace" in refused.message
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = llm.engine
    engine.add_request(PROMPTS[0], params, "live", request_id="running")
    for _ in range(3):
        engine.step()  # prefilled and decoding on v1
    assert llm.load_adapter_from_tensors("live", *files_of(v2), replace=True)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [o.token_ids for o in engine.step() if o.request_id == "running" and o.finished]
    assert tokens == [hf_greedy(base, v1, PROMPTS[0], 10)]
    outputs = llm.generate(PROMPTS, params, adapters="live")
    assert [o.token_ids for o in outputs] == [hf_greedy(base, v2, p, 10) for p in PROMPTS]
    assert {o.revision for o in outputs} != {revision} and outputs[0].revision.startswith("live@")


def _hostile(tensors: dict, config: dict) -> dict:
    """name -> (tensors, config): one fault each, in values a file can hold too."""
    key_a = next(k for k in tensors if "q_proj.lora_A" in k)
    key_b = key_a.replace("lora_A", "lora_B")

    def edit(key, value):
        return {**tensors, key: value}, config

    return {
        "nan": edit(key_b, torch.full_like(tensors[key_b], float("nan"))),
        "huge": edit(key_b, tensors[key_b] * 1e30),
        "int": edit(key_a, tensors[key_a].to(torch.int32)),
        "shape": edit(key_a, tensors[key_a][:, :-1].contiguous()),
        "rank": ({**tensors, key_a: torch.randn(32, tensors[key_a].shape[1]),
                  key_b: torch.randn(tensors[key_b].shape[0], 32)}, config),
        "stray": edit("base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight", tensors[key_a].clone()),
        "unpaired": ({k: t for k, t in tensors.items() if k != key_b}, config),
        "dora_without_magnitudes": (tensors, {**config, "use_dora": True}),
    }


def test_a_hostile_push_is_refused_as_the_same_files_are_and_nothing_changes(setup, tmp_path):
    base, llm, root = setup
    good = save_peft_adapter(base, root / "good", seed=3, r=8, target_modules=ATTENTION)
    assert llm.load_adapter("kept", good)
    before = [o.token_ids for o in run(llm, "kept")]
    for case, (tensors, config) in _hostile(*files_of(good)).items():
        pushed = llm.load_adapter_from_tensors("x", tensors, config)
        save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
        (tmp_path / "adapter_config.json").write_text(json.dumps(config))
        read = llm.load_adapter("x", str(tmp_path))
        assert pushed != LoRAStatus.SUCCESS and read != LoRAStatus.SUCCESS, case
        assert (pushed.status, pushed.message) == (read.status, read.message), case
    for tensors, config, words in ((None, {}, "tensors must be"), ({"k": [1.0]}, {}, "not a dense tensor"),
                                   ({"k": torch.zeros(2)}, "{}", "config must be a dict")):
        result = llm.load_adapter_from_tensors("x", tensors, config)
        assert result == LoRAStatus.LOAD_INVALID_ADAPTER and words in result.message
    assert "x" not in llm.engine.adapters.loras and [o.token_ids for o in run(llm, "kept")] == before
