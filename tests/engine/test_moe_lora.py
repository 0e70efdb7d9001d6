"""LoRA on mixture-of-experts models in mixed batches: PEFT's target_parameters on the 3D expert weights,
attention LoRA, embedding / head LoRA and a saved head, with base rows beside them; each row gives the
prompt logprobs and greedy tokens of HF + PEFT running its adapter alone (fp32). An adapter in the older
per-expert layout gives the same answers as the same weights in the 3D layout; router LoRA is refused."""
import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_prompt_logprobs_equal_peft, hf_greedy, save_checkpoint
from conftest import save_distinct_adapter as save_adapter
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.config import DEFAULT_TARGET_MODULES
from loramux.llm import LLM
from loramux.models.moe import FusedExperts
from loramux.ops import MOE_BACKENDS, moe_cpu, moe_torch, moe_triton
from models.test_moe import tiny_moe

TARGETS = (*DEFAULT_TARGET_MODULES, "experts", "embed_tokens", "lm_head")
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def per_expert_copy(src: str, dst, num_experts: int, kind: str) -> str:
    """The 3D experts adapter rewritten with one Linear's LoRA per expert (the pre-transformers-5 layout)."""
    os.makedirs(dst, exist_ok=True)
    tensors, out = load_file(os.path.join(src, "adapter_model.safetensors")), {}
    names = {"gate": "w1", "up": "w3", "down": "w2"} if kind == "mixtral" else \
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for key, t in tensors.items():
        if ".mlp.experts." not in key:
            out[key] = t
            continue
        layer = key.split(".mlp.experts.")[0]
        if "lora_A" not in key:
            continue
        a, b = t, tensors[key.replace("lora_A", "lora_B")]
        r = a.shape[0] // num_experts
        a_e, b_e = a.reshape(num_experts, r, -1), b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)
        for e in range(num_experts):
            prefix = f"{layer}.{block}.experts.{e}"
            if ".base_layer." in key:  # gate_up_proj: the same A for both halves
                half = b_e.shape[1] // 2
                for proj, rows in (("gate", slice(0, half)), ("up", slice(half, None))):
                    out[f"{prefix}.{names[proj]}.lora_A.weight"] = a_e[e].clone()
                    out[f"{prefix}.{names[proj]}.lora_B.weight"] = b_e[e, rows].clone()
            else:
                out[f"{prefix}.{names['down']}.lora_A.weight"] = a_e[e].clone()
                out[f"{prefix}.{names['down']}.lora_B.weight"] = b_e[e].clone()
    save_file(out, os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    config["target_modules"] = sorted(set(config["target_modules"]) | set(names.values()))
    config["target_parameters"] = None
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_moe/torch", pytest.param(
    "qwen3_moe/triton", marks=pytest.mark.skipif(not moe_triton.available("cpu"), reason="needs triton"))])
def setup(request, tmp_path_factory):
    """An engine on each family with its fused-experts op chosen as "auto" picks it (the C++ kernel on a CPU
    that runs it), one on the torch reference op, and one with the LoRA and expert LoRA in Triton (the CUDA
    path's kernels, in Triton's interpreter here)."""
    kind, _, moe_backend = request.param.partition("/")
    root = tmp_path_factory.mktemp(kind)
    base = tiny_moe(kind, tie_word_embeddings=kind == "qwen3_moe")
    experts = base.config.num_local_experts if kind == "mixtral" else base.config.num_experts
    adapters = {
        "experts": save_adapter(base, root / "a", 1, r=4, target_modules=["q_proj"], target_parameters=EXPERTS),
        "attention": save_adapter(base, root / "b", 2, r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "emb_head": save_adapter(base, root / "c", 3, r=6, target_modules=["embed_tokens", "lm_head"],
                                 target_parameters=["mlp.experts.down_proj"]),
        "save_head": save_adapter(base, root / "d", 4, r=2, target_modules=["v_proj"], modules_to_save=["lm_head"]),
    }
    adapters["per_expert"] = per_expert_copy(adapters["experts"], root / "e", experts, kind)
    llm = LLM(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**23, max_model_len=64,
              moe_backend=moe_backend or "auto", lora_backend="triton" if moe_backend == "triton" else "auto",
              lora=LoRAConfig(max_loras=5, max_lora_rank=8, target_modules=TARGETS,
                              max_module_copies_bytes=8 * base.config.vocab_size * base.config.hidden_size))
    for name, path in adapters.items():
        result = llm.load_adapter(name, path)
        assert result, result.message
    ops = {m.op for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedExperts)}
    expected = MOE_BACKENDS[moe_backend] if moe_backend else moe_cpu if moe_cpu.available() else moe_torch
    assert ops == {expected.fused_experts}
    return base, adapters, llm


ROWS = ["experts", None, "attention", "emb_head", "save_head", "per_expert", "experts"]


def test_mixed_rows_give_peft_prompt_logprobs(setup):
    base, adapters, llm = setup
    prompts = [[5 + 3 * i, 17, 33 + 2 * i, 9, 64 - i, 3, 100 - 5 * i] for i in range(len(ROWS))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapters=ROWS)
    for prompt, row, out in zip(prompts, ROWS, outs):
        oracle_dir = adapters["experts"] if row == "per_expert" else adapters.get(row)  # the same weights, 3D
        assert_prompt_logprobs_equal_peft(out, base, oracle_dir, prompt, msg=lambda m, row=row: f"{row}: {m}")


def test_mixed_rows_give_peft_greedy_tokens(setup):
    base, adapters, llm = setup
    prompts = [[7, 8 + i, 9, 10 + 3 * i] for i in range(len(ROWS))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), adapters=ROWS)
    for prompt, row, out in zip(prompts, ROWS, outs):
        oracle_dir = adapters["experts"] if row == "per_expert" else adapters.get(row)
        assert out.token_ids == hf_greedy(base, oracle_dir, prompt, 8), row


def test_router_lora_is_refused_naming_it(setup, tmp_path):
    base, adapters, llm = setup
    tensors = load_file(os.path.join(adapters["attention"], "adapter_model.safetensors"))
    hidden, experts = base.config.hidden_size, base.model.layers[0].mlp.gate.weight.shape[0]
    tensors["base_model.model.model.layers.0.mlp.gate.lora_A.weight"] = torch.zeros(8, hidden)  # PEFT cannot make
    tensors["base_model.model.model.layers.0.mlp.gate.lora_B.weight"] = torch.zeros(experts, 8)  # these (not a Linear)
    os.makedirs(tmp_path / "router")
    save_file(tensors, tmp_path / "router" / "adapter_model.safetensors")
    with open(os.path.join(adapters["attention"], "adapter_config.json")) as f:
        config = json.load(f)
    with open(tmp_path / "router" / "adapter_config.json", "w") as f:
        json.dump({**config, "target_modules": config["target_modules"] + ["gate"]}, f)
    result = llm.load_adapter("router", str(tmp_path / "router"))
    assert result == LoRAStatus.LOAD_INVALID_ADAPTER and "router" in result.message


def test_per_expert_gate_and_up_loras_of_their_own_equal_the_merged_weights(setup, tmp_path):
    """Older checkpoints give gate and up separate A's (one slice each): the oracle is the base model with every
    expert's weights merged (W + s * B @ A), as PEFT would merge them."""
    base, adapters, llm = setup
    kind, layer = base.config.model_type, base.model.layers[0].mlp
    num, inter = layer.experts.gate_up_proj.shape[0], layer.experts.gate_up_proj.shape[1] // 2
    hidden, r, scale = base.config.hidden_size, 3, 2.0
    names = {"gate": "w1", "up": "w3", "down": "w2"} if kind == "mixtral" else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    gen, tensors, merged = torch.Generator().manual_seed(11), {}, copy.deepcopy(base)
    for i, hf_layer in enumerate(merged.model.layers):
        experts = getattr(hf_layer.mlp, "experts", None)
        if experts is None:
            continue  # a dense layer (Qwen2-MoE's mlp_only_layers)
        for e in range(num):
            for proj, (n_in, n_out) in (("gate", (hidden, inter)), ("up", (hidden, inter)), ("down", (inter, hidden))):
                a, b = torch.randn(r, n_in, generator=gen) * 0.3, torch.randn(n_out, r, generator=gen) * 0.3
                key = f"base_model.model.model.layers.{i}.{block}.experts.{e}.{names[proj]}"
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
                with torch.no_grad():
                    if proj == "down":
                        experts.down_proj[e] += scale * b @ a
                    else:
                        rows = slice(0, inter) if proj == "gate" else slice(inter, None)
                        experts.gate_up_proj[e, rows] += scale * b @ a
    path = tmp_path / "per_expert_distinct"
    os.makedirs(path)
    save_file(tensors, path / "adapter_model.safetensors")
    with open(path / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": r * scale, "target_modules": sorted(names.values())}, f)
    assert llm.load_adapter("distinct", str(path))
    prompt = [4, 44, 14, 90, 31, 7, 61, 2, 19]
    out = llm.generate([prompt, prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                       adapters=["distinct", None])
    with torch.no_grad():
        oracle = torch.log_softmax(merged(torch.tensor([prompt])).logits[0].float(), -1)
    expected = oracle[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(out[0].prompt_logprobs.logprobs), expected, atol=1e-4, rtol=1e-4)
    assert llm.unload_adapter("distinct")


def test_an_engine_without_expert_lora_refuses_expert_adapters_saying_how_to_serve_them(setup, tmp_path):
    """The default target_modules leave the experts unwrapped (their slots are large): an adapter with expert LoRA
    is refused by what it holds, naming the setting, not by a file-size bound that leaves the experts out."""
    base, adapters, llm = setup
    plain = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
                max_model_len=32, lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    result = plain.load_adapter("experts", adapters["experts"])
    assert result == LoRAStatus.LOAD_INVALID_ADAPTER
    assert "MoE experts" in result.message and "add 'experts' to LoRAConfig.target_modules" in result.message
    assert plain.load_adapter("attention", adapters["attention"])


def test_batch_invariance_is_refused_for_moe_models(setup, tmp_path):
    base, _, _ = setup
    with pytest.raises(ValueError, match="batch_invariant does not cover mixture-of-experts"):
        LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
            max_model_len=32, batch_invariant=True)


def served_like_peft(llm, base, name: str, path: str) -> None:
    """Load `path` as `name`: its prompt logprobs equal PEFT's for that adapter alone; unload it."""
    result = llm.load_adapter(name, path)
    assert result, result.message
    prompt = [5, 17, 33, 9, 64, 3, 100]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapters=[name])[0]
    assert_prompt_logprobs_equal_peft(out, base, path, prompt)
    assert llm.unload_adapter(name)


@pytest.mark.parametrize("pattern", [dict(alpha_pattern={"down_proj": 64}), dict(rank_pattern={"gate_up_proj": 8}),
                                     dict(use_rslora=True)])
def test_expert_parameters_take_their_own_rank_and_alpha_patterns(setup, tmp_path, pattern):
    """PEFT matches rank_pattern / alpha_pattern against the parameter (mlp.experts.down_proj), not the block."""
    base, _, llm = setup
    path = save_adapter(base, tmp_path / "a", 7, r=4, target_modules=["q_proj"], target_parameters=EXPERTS, **pattern)
    served_like_peft(llm, base, f"pattern-{tmp_path.name}", path)


def test_layers_to_transform_leaves_target_parameters_in_every_layer_as_peft(setup, tmp_path):
    base, _, llm = setup
    path = save_adapter(base, tmp_path / "a", 8, r=4, target_modules=["q_proj"], target_parameters=EXPERTS,
                        layers_to_transform=[0])
    served_like_peft(llm, base, f"ltt-{tmp_path.name}", path)


def test_per_expert_weights_the_config_does_not_target_are_refused(setup, tmp_path):
    base, adapters, llm = setup
    with open(os.path.join(adapters["per_expert"], "adapter_config.json")) as f:
        config = json.load(f)
    down = "w2" if base.config.model_type == "mixtral" else "down_proj"
    os.makedirs(tmp_path / "a")
    shutil.copy(os.path.join(adapters["per_expert"], "adapter_model.safetensors"), tmp_path / "a")
    with open(tmp_path / "a" / "adapter_config.json", "w") as f:
        json.dump({**config, "target_modules": [m for m in config["target_modules"] if m != down]}, f)
    result = llm.load_adapter("untargeted", str(tmp_path / "a"))
    assert result == LoRAStatus.LOAD_INVALID_ADAPTER and "does not target" in result.message and down in result.message


def test_expert_adapters_given_at_start_get_the_experts_wrapped(setup, tmp_path):
    base, adapters, _ = setup
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
              max_model_len=32, lora=LoRAConfig(max_loras=1, max_lora_rank=8), adapters={"experts": adapters["experts"]})
    assert "experts" in llm.engine.core.config.lora.targets
    prompt = [5, 6, 7]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapters="experts")
    assert out[0].token_ids == hf_greedy(base, adapters["experts"], prompt, 6)
