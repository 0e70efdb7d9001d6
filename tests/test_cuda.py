"""The CUDA path, run where a GPU is (skipped elsewhere): the Triton LoRA kernels on the device against the
reference, and a mixed batch on the engine with every backend "auto" (the Triton op on CUDA) against HF +
PEFT running each adapter alone."""
import pytest
import torch

from conftest import ADAPTER_KINDS, hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig
from loramux.config import DEFAULT_TARGET_MODULES
from loramux.llm import LLM
from loramux.ops import LoRAMapping, lora_triton, select_backend
from loramux.ops.lora_torch import add_lora_gathered
from loramux.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("n_tokens", [1, 32, 1000])  # decode at batch 1 and 32, a prefill
def test_triton_op_on_cuda(dtype, tol, n_tokens):
    assert select_backend("auto", "cuda") is lora_triton.add_lora_triton
    torch.manual_seed(0)
    slices, n_in, rank, slots = (2048, 512, 512), 2048, 16, 8
    lora_a = torch.randn(slots, 3 * rank, n_in, dtype=dtype, device="cuda") * 0.05
    lora_b = torch.randn(slots, sum(slices), rank, dtype=dtype, device="cuda") * 0.05
    mapping = LoRAMapping.from_slots(torch.randint(-1, slots, (n_tokens,)).tolist(), "cuda")
    x = torch.randn(n_tokens, n_in, dtype=dtype, device="cuda")
    y0 = torch.randn(n_tokens, sum(slices), dtype=dtype, device="cuda")
    expected = y0.float().clone()
    add_lora_gathered(expected, x.float(), lora_a.float(), lora_b.float(), mapping, slices)
    y = y0.clone()
    lora_triton.add_lora_triton(y, x, lora_a, lora_b, mapping, slices)
    torch.testing.assert_close(y.float(), expected, atol=tol * 10, rtol=tol)


def test_splits_on_cuda_are_chosen_and_agree_with_the_whole():
    """At batch 1 the public ops split (this GPU's SMs against 3 shrink programs, 8 attention programs); the
    split results equal the unsplit ones within bf16, and the same bits every run."""
    from loramux.ops import attention_triton
    from loramux.ops.triton_tiles import AttentionTiles, LoRATiles

    assert lora_triton.split_k(LoRATiles(), 1, 8, 3, 2048, "cuda") > 1
    assert attention_triton.split_kv(AttentionTiles(), 1, 8, 4096, "cuda") > 1
    torch.manual_seed(0)
    lora_a = torch.randn(8, 48, 2048, dtype=torch.bfloat16, device="cuda") * 0.05
    lora_b = torch.randn(8, 3072, 16, dtype=torch.bfloat16, device="cuda") * 0.05
    x, mapping = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda"), LoRAMapping.from_slots([3], "cuda")
    ys = []
    for split in (8, 8, 1):
        y = torch.zeros(1, 3072, dtype=torch.bfloat16, device="cuda")
        lora_triton.launch(y, x, lora_a, lora_b, mapping, (2048, 512, 512), None, LoRATiles(), split)
        ys.append(y)
    assert torch.equal(ys[0], ys[1])
    torch.testing.assert_close(ys[0], ys[2], atol=2e-2, rtol=2e-2)
    k = torch.randn(64 * 16, 8, 64, dtype=torch.bfloat16, device="cuda")
    v, q = torch.randn_like(k), torch.randn(1, 32, 64, dtype=torch.bfloat16, device="cuda")
    tables, lens = torch.arange(64, device="cuda").view(1, 64), torch.tensor([1000], device="cuda")
    outs = [attention_triton.launch(q, k, v, tables, lens, 16, 0.125, AttentionTiles(), split) for split in (16, 16, 1)]
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2], atol=2e-2, rtol=2e-2)


def test_mixed_batch_on_cuda_equals_hf_peft_alone(tmp_path):
    llm = mixed_batch_equals_hf_peft_alone(tmp_path, "cuda")
    assert llm.engine.adapters.slots.copies.stream is not None  # slot writes on a side stream
    weights = llm.engine.adapters.store._weights.values()  # the host tier: page-locked, for DMA slot writes
    assert all(t.is_pinned() for w in weights for m in w.modules.values() for t in (m.a, m.b))
    assert all(t.is_pinned() for w in weights for t in w.copies.values())


def mixed_batch_equals_hf_peft_alone(tmp_path, device: str) -> LLM:
    """Adapters of ranks 4-64, patterns, rsLoRA, and a saved output head, mixed with base rows, on `device`
    with every backend "auto": each row's greedy tokens are HF + PEFT's for its adapter alone."""
    from conftest import TINY

    base = tiny_llama()
    adapters = {name: save_peft_adapter(base, tmp_path / name, seed=i, **ADAPTER_KINDS[name])
                for i, name in enumerate(("r4", "r8_rslora", "r16_patterns", "r64_qv"))}
    adapters["save_head"] = save_peft_adapter(base, tmp_path / "save_head", seed=9, r=4, lora_alpha=8,
                                              target_modules=["v_proj"], modules_to_save=["lm_head"])
    lora = LoRAConfig(max_loras=5, max_lora_rank=64, target_modules=(*DEFAULT_TARGET_MODULES, "lm_head"),
                      max_module_copies_bytes=4 * TINY["vocab_size"] * TINY["hidden_size"] * 4)
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), lora=lora, dtype="float32", device=device,
              kv_cache_memory=2**24)
    for name, path in adapters.items():
        assert llm.load_adapter(f"{name}={path}")
    rows = ["r4", None, "r8_rslora", "r16_patterns", "r64_qv", None, "save_head", "r4", "r64_qv", "save_head"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (5 + i,), generator=gen).tolist() for i in range(len(rows))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, adapter, out in zip(prompts, rows, llm.generate(prompts, params, adapters=rows)):
        assert out.token_ids == hf_greedy(base, adapters.get(adapter), prompt, params.max_tokens), adapter
    return llm


def test_fused_experts_with_expert_lora_on_cuda():
    from loramux.ops import moe_triton, select_moe_backend
    from loramux.ops.moe_torch import ExpertLoRA, fused_experts, route

    assert select_moe_backend("auto", "cuda") is moe_triton
    torch.manual_seed(0)
    experts, hidden, inter, rank, slots, tokens = 8, 256, 128, 8, 3, 64
    gate_up, down = torch.randn(experts, 2 * inter, hidden) * 0.05, torch.randn(experts, hidden, inter) * 0.05
    ranks = [rank, 0, rank // 2]
    lora = ExpertLoRA(torch.randn(slots, experts, 2 * rank, hidden) * 0.1,
                      (torch.randn(slots, experts, rank, 2 * inter) * 0.1).transpose(2, 3),
                      torch.randn(slots, experts, rank, inter) * 0.1,
                      (torch.randn(slots, experts, rank, hidden) * 0.1).transpose(2, 3),
                      ranks, torch.tensor(ranks).repeat_interleave(experts), torch.tensor([t % 4 - 1 for t in range(tokens)]))
    for s, r in enumerate(ranks):  # zero beyond each slot's rank, as LoRAExperts keeps it
        lora.gate_up_a.view(slots, experts, 2, rank, hidden)[s, :, :, r:] = 0
        lora.gate_up_b[s, :, :, r:] = lora.down_a[s, :, r:] = lora.down_b[s, :, :, r:] = 0
    x = torch.randn(tokens, hidden)
    weights, ids = route(torch.randn(tokens, experts), 2, True, False)
    expected = fused_experts(x, gate_up, down, ids, weights, lora)
    cuda = ExpertLoRA(*(t.cuda() for t in (lora.gate_up_a, lora.gate_up_b, lora.down_a, lora.down_b)), ranks,
                      lora.expert_ranks.cuda(), lora.token_slots.cuda())
    out = moe_triton.fused_experts(x.cuda(), gate_up.cuda(), down.cuda(), ids.cuda(), weights.cuda(), cuda)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_attention_on_cuda(dtype, tol):
    from loramux.ops import attention_triton, select_attention_backend
    from loramux.ops.attention_torch import decode_attention_torch

    assert select_attention_backend("auto", "cuda") is attention_triton.decode_attention_triton
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, block_size, num_blocks = 32, 32, 8, 64, 16, 700
    k_cache, v_cache = (torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device="cuda")
                        for _ in range(2))
    lens = torch.randint(1, 300, (batch,), device="cuda")
    tables = torch.randperm(num_blocks, device="cuda")[: batch * 19].view(batch, 19)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
    args = (q, k_cache, v_cache, tables, lens, block_size, head_dim**-0.5)
    expected = decode_attention_torch(*(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    out = attention_triton.decode_attention_triton(*args)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_a_quantized_gguf_on_cuda_is_dequantized_at_load(tmp_path):
    """No quantized-matmul kernel for CUDA: the torch reference would dequantize every weight at every call."""
    from support.gguf_files import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from loramux.layers.quantized import QuantizedEmbedding, QuantizedLinear

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)).eval()
    path = write_gguf(hf, str(tmp_path / "model.gguf"), lambda name, is_2d: "Q6_K" if "attn_v" in name else "Q4_K")
    llm = LLM(model=path, device="cuda", dtype="float32", kv_cache_memory=2**24)
    modules = list(llm.engine.core.runner.model.modules())
    assert not any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in modules)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_prefix_cache_on_cuda_gives_the_tokens_of_hf_peft(tmp_path):
    prefix_cache_equals_hf_peft(tmp_path, "cuda")


def prefix_cache_equals_hf_peft(tmp_path, device: str) -> None:
    """Prompts sharing 40 tokens under two adapters and the base, run twice (the second time from cached
    blocks, chunked prefill on): each row's greedy tokens are HF + PEFT's, and the cache was hit."""
    base = tiny_llama()
    adapters = {name: save_peft_adapter(base, tmp_path / name, seed=i) for i, name in enumerate(("a", "b"))}
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), lora=LoRAConfig(max_loras=2, max_lora_rank=8),
              dtype="float32", device=device, kv_cache_memory=2**24, block_size=16)
    for name, path in adapters.items():
        assert llm.load_adapter(f"{name}={path}")
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 128, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 128, (1 + i,), generator=gen).tolist() for i in range(6)]
    rows = ["a", None, "b", "a", None, "b"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate(prompts, params, adapters=rows)
    again = llm.generate(prompts, params, adapters=rows)
    assert llm.engine.core.block_manager.hits >= 6 * 32  # every row's two full shared blocks, the second time
    for prompt, adapter, one, two in zip(prompts, rows, first, again):
        want = hf_greedy(base, adapters.get(adapter), prompt, params.max_tokens)
        assert one.token_ids == want and two.token_ids == want, adapter


def test_decode_as_cuda_graphs_equals_eager_and_syncs_nothing(tmp_path):
    """The decode steps replayed as CUDA graphs (captured at start) give the eager engine's tokens for a mixed
    batch, sampled rows with seeds included; a decode forward through the graphs makes no host sync."""
    from loramux.engine.sequence import Sequence

    base = tiny_llama()
    adapters = {name: save_peft_adapter(base, tmp_path / name, seed=i, **ADAPTER_KINDS[name])
                for i, name in enumerate(("r4", "r16_patterns"))}
    model = save_checkpoint(base, tmp_path / "model")
    rows = ["r4", None, "r16_patterns", "r4", None]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (5 + 3 * i,), generator=gen).tolist() for i in range(len(rows))]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)] * 3
    outputs = {}
    for eager in (False, True):
        llm = LLM(model=model, lora=LoRAConfig(max_loras=2, max_lora_rank=16), dtype="float32", device="cuda",
                  kv_cache_memory=2**24, max_num_seqs=8, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        for name, path in adapters.items():
            assert llm.load_adapter(f"{name}={path}")
        outputs[eager] = [o.token_ids for o in llm.generate(prompts, params[:len(rows)], adapters=rows)]
        if not eager:
            core = llm.engine.core
            slots = [core.adapters.activate_adapter(n) if n else -1 for n in rows]
            seqs = [Sequence(list(p), params[0], n, f"s{i}") for i, (p, n) in enumerate(zip(prompts, rows))]
            for seq in seqs:
                core.block_manager.allocate(seq)
            core.runner.run(seqs, slots, is_prefill=True)
            for seq in seqs:
                seq.num_computed_tokens = len(seq)
                seq.append_token(1)
                core.block_manager.may_append(seq)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.inference_mode():
                    core.runner._decode(seqs, slots)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for seq in seqs:
                core.block_manager.deallocate(seq)
    assert outputs[False] == outputs[True]
    for prompt, adapter, tokens, p in zip(prompts, rows, outputs[False], params):
        if p.temperature == 0:
            assert tokens == hf_greedy(base, adapters.get(adapter), prompt, p.max_tokens), adapter


def test_moe_and_embedding_lora_decode_as_cuda_graphs_equals_eager(tmp_path):
    """An MoE model with expert and embedding LoRA, now captured (the grouped-GEMM experts op, the embedding
    through the LoRA op): graphs give the eager engine's tokens and HF + PEFT's greedy ones."""
    from conftest import save_distinct_adapter
    from models.test_moe import tiny_moe

    base = tiny_moe("qwen3_moe")
    adapters = {
        "experts": save_distinct_adapter(base, tmp_path / "experts", 1, r=4, target_modules=["q_proj"],
                                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        "emb": save_distinct_adapter(base, tmp_path / "emb", 2, r=4, target_modules=["embed_tokens", "v_proj"]),
    }
    model = save_checkpoint(base, tmp_path / "model")
    rows = ["experts", None, "emb", "experts"]
    prompts = [[5 + i, 9, 14, 3 + 2 * i] for i in range(len(rows))]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        llm = LLM(model=model, dtype="float32", device="cuda", kv_cache_memory=2**24, max_num_seqs=8,
                  enforce_eager=eager, lora=LoRAConfig(max_loras=2, max_lora_rank=8,
                                                       target_modules=(*DEFAULT_TARGET_MODULES, "experts", "embed_tokens")))
        assert (llm.engine.runner.graphs is None) == eager
        for name, path in adapters.items():
            assert llm.load_adapter(f"{name}={path}")
        outputs[eager] = [o.token_ids for o in llm.generate(prompts, greedy, adapters=rows)]
    assert outputs[False] == outputs[True]
    for prompt, adapter, tokens in zip(prompts, rows, outputs[False]):
        assert tokens == hf_greedy(base, adapters.get(adapter), prompt, greedy.max_tokens), adapter


def test_dora_alora_and_a_combination_on_cuda_equal_hf_peft_alone(tmp_path):
    """The three adapter kinds in one batch on the GPU (slot writes on the side stream, DoRA turning decode eager
    while it holds a slot, aLoRA's base-model prefix), each row's greedy tokens HF + PEFT's (on the CPU)."""
    from engine.test_adapter_kinds import PAIR, PROMPTS, ROWS, _adapters, _oracle
    from engine.test_combinations import peft_greedy

    base = tiny_llama()
    adapters = _adapters(base, tmp_path)
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", device="cuda", kv_cache_memory=2**24,
              max_model_len=64, lora=LoRAConfig(max_loras=6, max_lora_rank=8))
    assert llm.engine.runner.graphs is not None  # captured; decode runs eagerly only while DoRA holds a slot
    for name, path in adapters.items():
        assert llm.load_adapter(name, path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapters=ROWS)
    for prompt, row, out in zip(PROMPTS, ROWS, outs):
        assert out.token_ids == peft_greedy(_oracle(base, adapters, row), prompt, 6), row
    assert PAIR in ROWS


@pytest.mark.parametrize("draft", [False, True])
def test_speculative_decoding_on_cuda_keeps_every_rows_tokens(tmp_path, draft):
    """n-gram lookup (and the model drafting for itself) on the GPU: verification steps run eagerly beside graph
    decode steps, and every row of a mixed batch gets the tokens it gets without speculation."""
    from engine.test_speculative import ROWS, repetitive_prompts

    base = tiny_llama()
    model = save_checkpoint(base, tmp_path / "model")
    adapters = {"r4": save_peft_adapter(base, tmp_path / "r4", seed=1, r=4),
                "r8_rslora": save_peft_adapter(base, tmp_path / "r8", seed=2, r=8, use_rslora=True),
                "r16": save_peft_adapter(base, tmp_path / "r16", seed=3, r=16)}
    spec = {"model": model, "num_speculative_tokens": 3} if draft else \
        {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

    def run(speculative_config):
        llm = LLM(model=model, dtype="float32", device="cuda", kv_cache_memory=2**24, max_model_len=128,
                  lora=LoRAConfig(max_loras=4, max_lora_rank=16), speculative_config=speculative_config)
        for name, path in adapters.items():
            assert llm.load_adapter(name, path)
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        return llm, llm.generate(repetitive_prompts(len(ROWS)), params, adapters=ROWS)

    _, plain = run(None)
    llm, spec_outs = run({**spec, "disable_by_batch_size": 16})
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec_outs]
    assert llm.engine.core.speculator.stats.num_accepted_tokens > 0
