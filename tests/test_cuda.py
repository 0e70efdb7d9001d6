"""The CUDA path, run where a GPU is (skipped elsewhere): the Triton LoRA kernels on the device against the
reference, and a mixed batch on the engine with every backend "auto" (the Triton op on CUDA) against HF +
PEFT running each adapter alone."""
import pytest
import torch

from conftest import ADAPTER_KINDS, hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig
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


def test_mixed_batch_on_cuda_equals_hf_peft_alone(tmp_path):
    base = tiny_llama()
    adapters = {name: save_peft_adapter(base, tmp_path / name, seed=i, **ADAPTER_KINDS[name])
                for i, name in enumerate(("r4", "r8_rslora", "r16_patterns", "r64_qv"))}
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), lora=LoRAConfig(max_loras=4, max_lora_rank=64),
              dtype="float32", device="cuda", kv_cache_memory=2**24)
    for name, path in adapters.items():
        assert llm.load_adapter(f"{name}={path}")
    rows = ["r4", None, "r8_rslora", "r16_patterns", "r64_qv", None, "r4", "r64_qv"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (5 + i,), generator=gen).tolist() for i in range(len(rows))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, adapter, out in zip(prompts, rows, llm.generate(prompts, params, adapters=rows)):
        assert out.token_ids == hf_greedy(base, adapters.get(adapter), prompt, params.max_tokens), adapter
