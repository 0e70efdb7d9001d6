"""The fused-experts backends against the torch reference (which the model tests hold to HF transformers and
PEFT): routing as each family does it, experts left without tokens, per-token expert LoRA of different
ranks (and a slot without expert LoRA) mixed with base tokens."""
import pytest
import torch

from loramux.ops import MOE_BACKENDS, moe_cpu, moe_triton
from loramux.ops.cpu_extension import REQUIRED_CPU_FLAGS, _cpu_flags
from loramux.ops.moe_torch import ExpertLoRA, fused_experts, route

E, K, SLOTS, MAX_RANK = 6, 2, 3, 8
SHAPES = {"odd": (40, 24), "tiles": (64, 96)}  # (hidden, intermediate); "tiles": the AMX path's multiples of 32
H, INTER = SHAPES["odd"]


def backend_or_skip(name):
    if name == "cpu" and not moe_cpu.available():
        pytest.skip("needs the C++ CPU kernels")
    if name == "triton" and not moe_triton.available("cpu"):
        pytest.skip("needs triton (its interpreter runs the expert LoRA here)")
    return MOE_BACKENDS[name]


def experts(dtype, seed=0, hidden=H, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(E, hidden, inter, generator=g) * 0.2).to(dtype)
    return gate_up, down


def expert_lora(dtype, token_slots, ranks=(4, 0, 8), hidden=H, inter=INTER):
    """Slots of rank 4, none and 8 (the padding beyond each rank zero, as LoRAExperts keeps it); b rank-major."""
    g = torch.Generator().manual_seed(5)
    shapes = {"gate_up_a": (2, hidden), "gate_up_b": (2 * inter,), "down_a": (1, inter), "down_b": (hidden,)}
    bufs = {}
    for name, shape in shapes.items():
        if name.endswith("_a"):
            buf = torch.zeros(SLOTS, E, shape[0], MAX_RANK, shape[1])
            for s, r in enumerate(ranks):
                buf[s, :, :, :r] = torch.randn(E, shape[0], r, shape[1], generator=g) * 0.3
            bufs[name] = buf.view(SLOTS, E, shape[0] * MAX_RANK, shape[1]).to(dtype)
        else:
            buf = torch.zeros(SLOTS, E, MAX_RANK, shape[0])
            for s, r in enumerate(ranks):
                buf[s, :, :r] = torch.randn(E, r, shape[0], generator=g) * 0.3
            bufs[name] = buf.to(dtype).transpose(2, 3)
    expert_ranks = torch.tensor(ranks).repeat_interleave(E)
    return ExpertLoRA(bufs["gate_up_a"], bufs["gate_up_b"], bufs["down_a"], bufs["down_b"], list(ranks),
                      expert_ranks, token_slots)


def routed(tokens, dtype, keep_float=False, seed=1, unused=(4,), hidden=H):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, E, generator=g)
    logits[:, list(unused)] = -1e4  # experts no token picks
    weights, ids = route(logits.to(dtype), K, True, keep_float)
    return x, ids, weights


def assert_matches(out, x, gate_up, down, ids, weights, lora=None):
    """fp32: the reference, to rounding. bf16: fp32 arithmetic on the same (bf16) numbers, within 2% of the
    output's scale: the backends round at different steps (add_lora once where the reference rounds twice,
    GEMMs block differently), so they differ from each other by about what each differs from exact."""
    assert out.dtype == x.dtype and out.shape == x.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, fused_experts(x, gate_up, down, ids, weights, lora), atol=1e-5, rtol=1e-5)
        return
    if lora is not None:
        lora = ExpertLoRA(lora.gate_up_a.float(), lora.gate_up_b.float(), lora.down_a.float(), lora.down_b.float(),
                          lora.ranks, lora.expert_ranks, lora.token_slots)
    exact = fused_experts(x.float(), gate_up.float(), down.float(), ids, weights.float(), lora)
    torch.testing.assert_close(out.float(), exact, atol=0.02 * exact.abs().max().item(), rtol=0)


@pytest.mark.parametrize("backend", list(MOE_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 150])  # 150: some experts get more than 32 rows (a GEMM each)
@pytest.mark.parametrize("keep_float", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_experts_equal_the_reference(backend, dtype, tokens, keep_float, shape):
    op = backend_or_skip(backend).fused_experts
    hidden, inter = SHAPES[shape]
    gate_up, down = experts(dtype, hidden=hidden, inter=inter)
    x, ids, weights = routed(tokens, dtype, keep_float, hidden=hidden)
    assert_matches(op(x, gate_up, down, ids, weights), x, gate_up, down, ids, weights)


@pytest.mark.parametrize("backend", list(MOE_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_expert_lora_per_token_equals_the_reference(backend, dtype, tokens, shape):
    op = backend_or_skip(backend).fused_experts
    hidden, inter = SHAPES[shape]
    gate_up, down = experts(dtype, hidden=hidden, inter=inter)
    x, ids, weights = routed(tokens, dtype, hidden=hidden)
    token_slots = torch.tensor([(-1, 0, 1, 2)[t % 4] for t in range(tokens)])
    lora = expert_lora(dtype, token_slots, hidden=hidden, inter=inter)
    out = op(x, gate_up, down, ids, weights, lora)
    assert_matches(out, x, gate_up, down, ids, weights, lora)
    base = op(x, gate_up, down, ids, weights)
    for t in range(tokens):  # base rows and the slot without expert LoRA are the base model's, to the bit
        if token_slots[t] in (-1, 1):
            assert torch.equal(out[t], base[t])
        else:
            assert (out[t].float() - base[t].float()).abs().max() > 0.1


def test_bf16_runs_use_amx_where_the_cpu_has_it_and_equal_the_reference_to_an_ulp():
    flags = _cpu_flags()
    if not all(f in flags for f in REQUIRED_CPU_FLAGS):
        pytest.skip("this CPU runs the torch path")
    assert moe_cpu.available()  # a kernel that fails to build falls back silently: not on a CPU that runs it
    assert moe_cpu.uses_amx() == ("amx_bf16" in flags)  # the path is not lost silently (a build without it, a refused syscall)
    hidden, inter = SHAPES["tiles"]
    gate_up, down = experts(torch.bfloat16, hidden=hidden, inter=inter)
    for tokens in (1, 5, 16, 40):  # runs of 1-32 rows (AMX) and longer (a GEMM)
        x, ids, weights = routed(tokens, torch.bfloat16, hidden=hidden)
        out, ref = moe_cpu.fused_experts(x, gate_up, down, ids, weights), fused_experts(x, gate_up, down, ids, weights)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * ref.float().abs().max().item())


def test_the_reference_is_a_per_token_loop():
    """The reference itself against the plainest form: each token, each of its experts, its slot's LoRA."""
    gate_up, down = experts(torch.float32)
    x, ids, weights = routed(5, torch.float32)
    token_slots = torch.tensor([0, -1, 2, 1, 0])
    lora = expert_lora(torch.float32, token_slots)
    out = fused_experts(x, gate_up, down, ids, weights, lora)
    for t in range(5):
        total = torch.zeros(H)
        for j in range(K):
            e, s = ids[t, j].item(), token_slots[t].item()
            gu = gate_up[e] @ x[t]
            if s >= 0 and lora.ranks[s]:
                r = lora.ranks[s]
                a = lora.gate_up_a[s, e]
                gu += torch.cat([lora.gate_up_b[s, e, :INTER, :r] @ (a[:r] @ x[t]),
                                 lora.gate_up_b[s, e, INTER:, :r] @ (a[MAX_RANK:MAX_RANK + r] @ x[t])])
            h = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            y = down[e] @ h
            if s >= 0 and lora.ranks[s]:
                y += lora.down_b[s, e, :, :r] @ (lora.down_a[s, e, :r] @ h)
            total += weights[t, j] * y
        torch.testing.assert_close(out[t], total, atol=1e-5, rtol=1e-5)
