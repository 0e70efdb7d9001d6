"""Quantized base models: GGUF files kept quantized, int8 / int4 / bitsandbytes at load, GPTQ, AWQ and
bitsandbytes 4-bit checkpoints. Each is checked against the same weights dequantized to fp32: transformers' own
GGUF loader for GGUF files, for GPTQ / AWQ (packed here, in their layouts) the formula w = s * (q - z) on the
integers we packed, and for bitsandbytes the model transformers + bitsandbytes (its CPU backend) run, with PEFT
on top."""
import json
import logging
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY, hf_greedy, save_checkpoint, save_peft_adapter
from support.gguf_files import write_gguf
from loramux import LoRAConfig, SamplingParams
from loramux.layers.quantized import QuantizedEmbedding, QuantizedLinear
from loramux.llm import LLM
from loramux.models.loader import load_model
from loramux.ops import QUANT_BACKENDS, lora_cpu, quant_cpu
from loramux.ops.quant_torch import dequantize, quantize
from models.test_llama import prefill_logits

WIDE = dict(TINY, hidden_size=256, intermediate_size=512)  # K-quants need inputs in multiples of 256
# {case: (model size, tied head, the GGUF type of each tensor)}: types as llama.cpp's presets mix them
GGUF_CASES = {
    "q8_0": (TINY, True, lambda name: "Q8_0"),
    "q4_0": (TINY, False, lambda name: "Q8_0" if name.startswith(("token_embd", "output")) else "Q4_0"),
    "q4_1": (TINY, True, lambda name: "Q8_0" if name.startswith("token_embd") else "Q4_1"),
    "q4_k_m": (WIDE, True, lambda name: "Q6_K" if "attn_v" in name or "ffn_down" in name else "Q4_K"),
    "q5_k": (WIDE, False, lambda name: "Q5_K"),
    "q5_0-dequantized": (TINY, False, lambda name: "Q5_0" if "ffn" in name else "F16"),
}


def use_backend(model, backend: str):
    """What the model runner does: every quantized layer runs the chosen backend's op."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.op = QUANT_BACKENDS[backend].quantized_linear
    return model


BACKENDS = ["torch"] + (["cpu"] if quant_cpu.available() else [])


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def gguf_case(request, tmp_path_factory):
    size, tied, type_of = GGUF_CASES[request.param]
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**size, tie_word_embeddings=tied)).eval()
    root = tmp_path_factory.mktemp(request.param)
    path = write_gguf(hf, str(root / "model.gguf"), lambda name, is_2d: type_of(name))
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(root), gguf_file="model.gguf", dtype=torch.float32).eval()
    return request.param, path, reference


def test_a_gguf_read_again_takes_its_tensors_from_the_saved_index_without_parsing_the_file(gguf_case, tmp_path,
                                                                                           monkeypatch):
    """gguf-py's reader parses every metadata field (a 49k vocabulary: ~2.5 s): a file's tensor index is kept
    after the first read, and a later read maps the file and takes the same tensors from it."""
    import gguf

    from loramux.models import gguf as ours
    from loramux.models.loader import _gguf_config_and_tokenizer

    _, path, _ = gguf_case
    hf_config, _ = _gguf_config_and_tokenizer(path)
    index = str(tmp_path / "index.json")
    first = ours.read_gguf_tensors(path, hf_config, keep_quantized=True, index_file=index)

    def never(*_, **__):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", never)
    again = ours.read_gguf_tensors(path, hf_config, keep_quantized=True, index_file=index)
    assert again.state.keys() == first.state.keys() and again.quantized.keys() == first.quantized.keys()
    assert all(torch.equal(again.state[k], v) for k, v in first.state.items())
    assert all(torch.equal(again.quantized[k].data, v.data) and again.quantized[k].fmt == v.fmt
               for k, v in first.quantized.items())
    with pytest.raises(AssertionError, match="parsed again"):  # no index: the reader it is
        ours.read_gguf_tensors(path, hf_config, keep_quantized=True, index_file=str(tmp_path / "other.json"))
    monkeypatch.undo()
    with open(index, "w") as f:
        f.write('{"arch": "lla')  # damaged: read again, and the index made again
    assert ours.read_gguf_tensors(path, hf_config, keep_quantized=True, index_file=index).state.keys() == first.state.keys()
    with open(index) as f:
        assert json.load(f)["arch"]


def test_the_gguf_cache_keeps_one_entry_per_file_that_still_exists(gguf_case, tmp_path, monkeypatch):
    import shutil

    from loramux.models.loader import _gguf_config_and_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, path, _ = gguf_case
    a, b = shutil.copy(path, tmp_path / "a.gguf"), shutil.copy(path, tmp_path / "b.gguf")
    _gguf_config_and_tokenizer(str(a))
    _gguf_config_and_tokenizer(str(b))
    root = tmp_path / "cache" / "loramux" / "gguf"
    assert len(os.listdir(root)) == 2
    os.remove(a)
    os.utime(b, ns=(10**18, 10**18))  # b changed: read again under a new key
    _gguf_config_and_tokenizer(str(b))
    (entry,) = os.listdir(root)
    with open(root / entry / "loramux-source.json") as f:
        assert json.load(f)["mtime_ns"] == 10**18


@pytest.mark.parametrize("backend", BACKENDS)
def test_gguf_kept_quantized_gives_the_logits_of_its_dequantized_weights(gguf_case, backend, caplog):
    case, path, reference = gguf_case
    with caplog.at_level(logging.WARNING):
        loaded = load_model(path, dtype="float32", max_model_len=64)
    model = use_backend(loaded.model, backend)
    layer = model.model.layers[0]
    if case == "q5_0-dequantized":  # no kernel for Q5_0: dequantized, with a warning naming the type
        assert "Q5_0" in caplog.text and isinstance(layer.mlp.down_proj, torch.nn.Linear)
    else:
        assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    if case == "q4_k_m":  # q|k in Q4_K, v in Q6_K: one layer, two weights
        assert [w.fmt for w in layer.self_attn.qkv_proj.weights] == ["q4_k", "q6_k"]
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids).logits
    # the order of the fp32 sums only: a few ulps of the logits' scale (the K-quant cases' logits reach ~40-120)
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(prefill_logits(model, input_ids), expected, atol=2e-5 * scale, rtol=1e-4)
    plain = sum(t.numel() * 4 for t in reference.state_dict().values())
    assert loaded.weight_bytes <= (plain if case == "q5_0-dequantized" else plain / 3)


def test_gguf_quantization_none_dequantizes_everything(gguf_case):
    case, path, reference = gguf_case
    loaded = load_model(path, dtype="float32", max_model_len=64, quantization="none")
    assert not any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in loaded.model.modules())
    input_ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        expected = reference(input_ids).logits
    torch.testing.assert_close(prefill_logits(loaded.model, input_ids), expected, atol=2e-5, rtol=1e-4)


def q4_k_m_llama(root) -> tuple[str, torch.nn.Module]:
    """A Q4_K_M-style GGUF of a tiny Llama (WIDE: K-quant shapes) at root/model.gguf, and the same weights
    dequantized by transformers' GGUF loader: the base an oracle runs against the quantized model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**WIDE, tie_word_embeddings=True)).eval()
    path = write_gguf(hf, str(root / "model.gguf"), lambda name, is_2d: GGUF_CASES["q4_k_m"][2](name))
    return path, AutoModelForCausalLM.from_pretrained(str(root), gguf_file="model.gguf", dtype=torch.float32).eval()


def dense_or_gguf(kind: str, root) -> tuple[str, torch.nn.Module]:
    """(model path, the oracle's base) for a module that runs on both bases: "dense", the tiny Llama as an HF
    checkpoint; "gguf", q4_k_m_llama."""
    if kind == "gguf":
        return q4_k_m_llama(root)
    from conftest import tiny_llama

    reference = tiny_llama()
    return save_checkpoint(reference, root / "model"), reference


@pytest.fixture(scope="module")
def mixed_setup(tmp_path_factory):
    """A Q4_K_M-style GGUF of a tiny Llama and three PEFT adapters of different ranks for it."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**WIDE, tie_word_embeddings=True)).eval()
    root = tmp_path_factory.mktemp("mixed")
    path = write_gguf(hf, str(root / "model.gguf"), lambda name, is_2d: GGUF_CASES["q4_k_m"][2](name))
    adapters = {f"a{r}": save_peft_adapter(hf, root / f"a{r}", seed=r, r=r) for r in (4, 8, 16)}
    return path, adapters


@pytest.mark.skipif(not quant_cpu.available(), reason="needs the C++ quantized-matmul kernel (x86, AVX2)")
def test_one_bf16_token_through_a_q4_k_m_model_equals_the_reference_op(mixed_setup):
    """Batch-1 decode in bf16 (one token: every K-quant matmul takes the vdpbf16ps path where the CPU has it)
    gives the logits of the same model through the fp32 reference op, within bf16's rounding."""
    path, _ = mixed_setup
    token = torch.tensor([[7]])
    logits = {}
    for backend in BACKENDS:
        model = use_backend(load_model(path, dtype="bfloat16", max_model_len=64).model, backend)
        logits[backend] = prefill_logits(model, token).float()
    torch.testing.assert_close(logits["cpu"], logits["torch"], atol=2e-2, rtol=2e-2)


def test_lora_on_a_kept_quantized_base_equals_the_dequantized_run(mixed_setup):
    """Mixed adapters in one batch over a quantized base: the greedy tokens of the same weights dequantized."""
    path, adapters = mixed_setup
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21]]
    rows = ["a4", None, "a16", "a8", "a4"]
    outputs = {}
    for quantization in (None, "none"):
        llm = LLM(model=path, lora=LoRAConfig(max_loras=3, max_lora_rank=16), dtype="float32",
                  quantization=quantization, kv_cache_memory=2**24, max_model_len=64)
        for name, adapter in adapters.items():
            assert llm.load_adapter(name, adapter)
        layer = llm.engine.core.runner.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(layer.base, QuantizedLinear) == (quantization is None)  # LoRA wraps the quantized layer
        outputs[quantization] = [o.token_ids for o in llm.generate(prompts, params, adapters=rows)]
    assert outputs[None] == outputs["none"]


@pytest.mark.parametrize("dtype, lora_dtype", [("float32", "auto"), ("float32", "bfloat16"), ("bfloat16", "auto")])
def test_one_request_at_a_time_on_a_quantized_base(mixed_setup, dtype, lora_dtype):
    """Batch-1 decode with an adapter over a quantized base, where each projection of one format runs its matmul
    and LoRA as one op (quantized_linear_lora): each adapter's greedy tokens, one request at a time, are those of
    the same engine with the two ops called apart, and in fp32 those of the same weights dequantized."""
    from loramux.layers.lora import LoRALinear

    path, adapters = mixed_setup
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def one_at_a_time(llm):
        return [llm.generate([[5, 6, 7, 8 + i]], params, adapters=[name])[0].token_ids
                for i, name in enumerate([*adapters, None])]

    outputs = {}
    for quantization in (None, "none"):
        llm = LLM(model=path, lora=LoRAConfig(max_loras=3, max_lora_rank=16, lora_dtype=lora_dtype), dtype=dtype,
                  quantization=quantization, kv_cache_memory=2**24, max_model_len=64)
        for name, adapter in adapters.items():
            assert llm.load_adapter(name, adapter)
        model = llm.engine.core.runner.model
        fused = quantization is None and quant_cpu.available() and lora_cpu.available()
        layer = model.model.layers[0]
        for projection in (layer.self_attn.o_proj, layer.mlp.gate_up_proj):  # q4_k (q|k|v mixes q4_k and q6_k)
            assert (projection.lora_op is quant_cpu.quantized_linear_lora) == fused
        outputs[quantization] = one_at_a_time(llm)
        if fused:
            for layer in model.modules():
                if isinstance(layer, LoRALinear):
                    layer.lora_op = None
            assert one_at_a_time(llm) == outputs[None]
    if dtype == "float32":
        assert outputs[None] == outputs["none"]


def test_batch_invariant_mode_keeps_the_two_calls(mixed_setup):
    """batch_invariant's LoRA op (fixed-row GEMMs) is not the C++ kernel: no one-call LoRA, whatever the batch."""
    from loramux.layers.lora import LoRALinear

    path, _ = mixed_setup
    llm = LLM(model=path, lora=LoRAConfig(max_loras=2, max_lora_rank=16), dtype="float32", batch_invariant=True,
              kv_cache_memory=2**24, max_model_len=64)
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, LoRALinear)]
    assert layers and all(layer.lora_op is None for layer in layers)


def plain_checkpoint(tmp_path, **extra):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY, **extra)).eval()
    return hf, save_checkpoint(hf, tmp_path / "plain")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantization, fmt", [("int8", "i8c"), ("int4", "i4g32")])
def test_int8_and_int4_at_load_give_the_logits_of_the_rounded_weights(tmp_path, backend, quantization, fmt):
    hf, path = plain_checkpoint(tmp_path)
    loaded = load_model(path, dtype="float32", quantization=quantization, group_size=32)
    model = use_backend(loaded.model, backend)
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head stays in the model's dtype
    reference = LlamaForCausalLM(hf.config).eval()
    state = {name: dequantize(quantize(t, fmt)) if t.dim() == 2 and "embed" not in name and "lm_head" not in name else t
             for name, t in hf.state_dict().items()}
    reference.load_state_dict(state)
    input_ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected = reference(input_ids).logits
    torch.testing.assert_close(prefill_logits(model, input_ids), expected, atol=2e-5, rtol=1e-4)


# ---- GPTQ and AWQ, packed here in their layouts --------------------------------------------------------------
def _words(nibbles: np.ndarray, axis: int, order=range(8)) -> torch.Tensor:
    """Pack 8 nibbles along `axis` into int32 words: position 8c + order[i] at bits 4i."""
    moved = np.moveaxis(nibbles.astype(np.uint32), axis, -1)
    groups = moved.reshape(*moved.shape[:-1], -1, 8)[..., list(order)]
    words = (groups << (np.arange(8, dtype=np.uint32) * 4)).sum(-1, dtype=np.uint32)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32))


def _quantize_int4(w: torch.Tensor, g_idx: torch.Tensor, groups: int):
    """Asymmetric int4 per (group, output): q [N, K], zeros and fp16-exact scales [groups, N]."""
    n = w.shape[0]
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)])  # [groups, N]
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)])
    scales = ((hi - lo) / 15).clamp(min=1e-4).half().float()
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(w / scales[g_idx].t() + zeros[g_idx].t()).clamp(0, 15)
    assert q.shape == (n, w.shape[1])
    return q.to(torch.int64), zeros.to(torch.int64), scales


def pack(method: str, w: torch.Tensor, group: int, act_order: bool = False):
    """One Linear's tensors in `method`'s layout, and the weight they stand for (s * (q - z), float32)."""
    k = w.shape[1]
    group = k if group == -1 else group  # -1: one group per output (per channel)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(7))]
    q, zeros, scales = _quantize_int4(w, g_idx, k // group)
    weight = scales[g_idx].t() * (q - zeros[g_idx].t()).float()
    if method == "gptq":  # v1 checkpoint format: zeros stored minus one
        tensors = {"qweight": _words(q.t().numpy(), 0), "qzeros": _words(((zeros - 1) & 0xF).numpy(), 1),
                   "scales": scales.half(), "g_idx": g_idx.to(torch.int32)}
    else:
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's packing order
        tensors = {"qweight": _words(q.t().numpy(), 1, order), "qzeros": _words(zeros.numpy(), 1, order),
                   "scales": scales.half()}
    return tensors, weight


def quantized_checkpoint(tmp_path, method: str, group: int, act_order: bool = False):
    """A tiny Llama saved as a `method` checkpoint; returns (its path, an HF model with the weights it holds)."""
    hf, path = plain_checkpoint(tmp_path, tie_word_embeddings=False)
    state, reference = load_file(os.path.join(path, "model.safetensors")), hf.state_dict()
    for name in [n for n in state if n.endswith("_proj.weight")]:
        tensors, weight = pack(method, state.pop(name), group, act_order)
        prefix = name.removesuffix(".weight")
        state.update({f"{prefix}.{key}": t for key, t in tensors.items()})
        reference[name] = weight
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                                      "sym": False, "checkpoint_format": "gptq"} if method == "gptq" else
                                     {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    model = LlamaForCausalLM(hf.config).eval()
    model.load_state_dict(reference)
    return path, model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method, group", [("gptq", 32), ("awq", 32), ("gptq", -1)])  # -1: i4g's groups repeat it
def test_gptq_and_awq_checkpoints_stay_int4_and_equal_their_weights(tmp_path, backend, method, group):
    path, reference = quantized_checkpoint(tmp_path, method, group)
    loaded = load_model(path, dtype="float32")
    model = use_backend(loaded.model, backend)
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.weights[0].fmt == "i4g32"
    input_ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected = reference(input_ids).logits
    torch.testing.assert_close(prefill_logits(model, input_ids), expected, atol=2e-5, rtol=1e-4)
    dequantized = load_model(path, dtype="float32", quantization="none").model
    torch.testing.assert_close(prefill_logits(dequantized, input_ids), expected, atol=2e-5, rtol=1e-4)


def test_act_order_gptq_is_dequantized_with_a_warning(tmp_path, caplog):
    path, reference = quantized_checkpoint(tmp_path, "gptq", 32, act_order=True)
    with caplog.at_level(logging.WARNING):
        model = load_model(path, dtype="float32").model
    assert "act-order" in caplog.text and isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    input_ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        expected = reference(input_ids).logits
    torch.testing.assert_close(prefill_logits(model, input_ids), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("config, words", [
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, r"bitsandbytes 8-bit \(LLM.int8\(\)\) checkpoints are not"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "4-bit type 'int4'"),
    ({"quant_method": "hqq"}, "quantized with 'hqq' are not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "gptq checkpoints with 8 bits are not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
])
def test_other_quantization_methods_are_refused_naming_them(tmp_path, config, words):
    _, path = plain_checkpoint(tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**data, "quantization_config": config}, f)
    with pytest.raises(ValueError, match=words):
        load_model(path, dtype="float32")


def bnb_checkpoint(root, kind: str, double: bool, intermediate_size: int = 128) -> str:
    """A tiny Llama quantized by transformers + bitsandbytes (its CPU backend), saved as transformers saves it."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from conftest import char_tokenizer, tiny_llama

    plain = save_checkpoint(tiny_llama(intermediate_size=intermediate_size), root / "plain")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=double,
                                bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(plain, quantization_config=config, device_map="cpu")
    model.save_pretrained(str(root / "bnb"))
    char_tokenizer().save_pretrained(str(root / "bnb"))
    return str(root / "bnb")


def bnb_dequantized(path: str):
    """The oracle's base: the checkpoint as transformers + bitsandbytes load it, its weights dequantized by
    bitsandbytes itself (model.dequantize(); bitsandbytes' own CPU matmul is not fp32-exact: ~2e-3 off here)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map="cpu").dequantize().float().eval()


@pytest.mark.parametrize("kind, double", [("nf4", False), ("nf4", True), ("fp4", True)])
def test_bitsandbytes_4bit_checkpoints_stay_4bit_and_give_bitsandbytes_and_peft_tokens(tmp_path, kind, double):
    """QLoRA's serving case: a bitsandbytes NF4 / FP4 base (double quantization or not) with adapters, mixed in
    one batch with base rows: every row gives the greedy tokens of transformers + bitsandbytes + PEFT alone."""
    from conftest import tiny_llama

    path = bnb_checkpoint(tmp_path, kind, double)
    base = tiny_llama(intermediate_size=128)
    adapters = {f"a{i}": save_peft_adapter(base, tmp_path / f"a{i}", seed=i, r=8) for i in range(2)}
    llm = LLM(model=path, dtype="float32", kv_cache_memory=2**22, lora=LoRAConfig(max_loras=2, max_lora_rank=8),
              adapters=adapters)
    layer = llm.engine.core.runner.model.model.layers[0].mlp.down_proj
    formats = {w.fmt for m in llm.engine.core.runner.model.modules() if isinstance(m, QuantizedLinear) for w in m.weights}
    assert formats == {f"{kind}g64"}, formats
    rows, prompts = ["a0", None, "a1"], [[5, 9, 14, 3], [7, 7, 21], [30, 2, 8, 8, 19]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapters=rows)
    reference = bnb_dequantized(path)
    for prompt, row, out in zip(prompts, rows, outs):
        assert out.token_ids == hf_greedy(reference, adapters.get(row), prompt, 6), (row, layer)
    input_ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        expected = reference(input_ids).logits
    torch.testing.assert_close(prefill_logits(load_model(path, dtype="float32").model, input_ids), expected,
                               atol=2e-5, rtol=1e-4)


def test_bitsandbytes_blocks_across_rows_are_dequantized_with_a_warning(tmp_path, caplog):
    """down_proj's rows of 96 inputs in blocks of 64: no 4-bit kernel, so its weight is dequantized at load, to
    what bitsandbytes' reference dequantization gives (its default backend: its CPU kernel reads such blocks per
    row, off by 0.036 here, farther from the original weights than the quantization error)."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from transformers import AutoModelForCausalLM

    path = bnb_checkpoint(tmp_path, "nf4", True, intermediate_size=96)
    with caplog.at_level(logging.WARNING):
        model = load_model(path, dtype="float32").model
    assert "blocks of 64 over rows of 96 inputs" in caplog.text
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantizedLinear)
    layer = model.model.layers[0].mlp.down_proj
    weight = AutoModelForCausalLM.from_pretrained(path, device_map="cpu").model.layers[0].mlp.down_proj.weight
    state = weight.quant_state
    absmax = state.state2.code[state.absmax.int()] * state.state2.absmax.repeat_interleave(256)[:96] + state.offset
    expected = _dequantize_4bit_compute(weight.data.reshape(-1), absmax, state.code, 64, state.shape, torch.float32)
    assert isinstance(layer, torch.nn.Linear) and torch.equal(layer.weight, expected)


def test_quantization_bitsandbytes_quantizes_a_plain_checkpoint_as_bitsandbytes_does(tmp_path):
    """quantization="bitsandbytes" (vLLM's spelling): NF4 in blocks of 64 (32 where the rows need it): the codes
    and absmax of bitsandbytes' own quantize_4bit, so the weights are the ones it dequantizes."""
    functional = pytest.importorskip("bitsandbytes.functional")
    base, path = plain_checkpoint(tmp_path)
    model = load_model(path, dtype="float32", quantization="bitsandbytes").model
    layer, plain = model.model.layers[0].self_attn.o_proj, base.model.layers[0].self_attn.o_proj.weight
    assert isinstance(layer, QuantizedLinear) and layer.weights[0].fmt == "nf4g64"
    packed, state = functional.quantize_4bit(plain.detach(), blocksize=64, quant_type="nf4")
    assert torch.equal(dequantize(layer.weights[0]), functional.dequantize_4bit(packed, state))
    down = model.model.layers[0].mlp.down_proj  # 96 inputs: blocks of 32
    assert down.weights[0].fmt == ("nf4g64" if base.config.intermediate_size % 64 == 0 else "nf4g32")
