"""LoRALinear against the merged weight W + s·B@A, and the packed layer against separate layers."""
import pytest
import torch
from torch import nn

from loramux.layers.lora import LoRAContext, LoRAHead, LoRALinear, PackedLoRALinear
from loramux.ops import LoRAMapping, select_backend


def make(base, max_loras=3, max_rank=8, cls=LoRALinear, **kw):
    return cls(base, max_loras=max_loras, max_rank=max_rank, context=LoRAContext(), add_lora=select_backend(), **kw)


def test_matches_merged_weight_per_slot_and_base_rows_untouched():
    torch.manual_seed(0)
    base = nn.Linear(16, 12, bias=True)
    layer = make(base)
    a, b = torch.randn(4, 16), torch.randn(12, 4)
    layer.set_slot(2, a, b, scaling=0.5)
    x = torch.randn(2, 3, 16)
    layer.context.mapping = LoRAMapping.from_slots([2, 2, 2, -1, -1, -1])
    y = layer(x)
    merged = base.weight + 0.5 * b @ a
    torch.testing.assert_close(y[0], x[0] @ merged.t() + base.bias)
    torch.testing.assert_close(y[1], base(x[1]))
    layer.clear_slot(2)
    assert layer.lora_a.abs().sum() == 0 and layer.lora_b.abs().sum() == 0


def test_fp16_weights_under_fp32_activations_widen_exactly_on_the_torch_op():
    """lora_dtype="float16" as CUDA runs it (the torch / Triton ops; CPU maps it to bfloat16): fp32 math on the
    fp16 weights widened, so fp16-representable weights give the fp32 layer's output."""
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    layer = LoRALinear(base, max_loras=2, max_rank=8, context=LoRAContext(), add_lora=select_backend("torch"),
                       dtype=torch.float16)
    a, b = torch.randn(4, 16).half().float(), torch.randn(12, 4).half().float()
    layer.set_slot(1, a, b, scaling=0.5)
    assert layer.lora_a.dtype == layer.lora_b.dtype == torch.float16
    x = torch.randn(5, 16)
    layer.context.mapping = LoRAMapping.from_slots([1] * 5)
    torch.testing.assert_close(layer(x), x @ (base.weight + 0.5 * b @ a).t() + base.bias)
    with pytest.raises(ValueError, match="only 16-bit LoRA weights under float32"):
        LoRALinear(base.bfloat16(), max_loras=2, max_rank=8, context=LoRAContext(), add_lora=select_backend("torch"),
                   dtype=torch.float16)


def test_slot_buffers_have_the_design_shapes_and_b_is_rank_major():
    layer = make(nn.Linear(16, 12), cls=PackedLoRALinear, output_slices=(8, 4))
    assert layer.lora_a.shape == (3, 2 * 8, 16) and layer.lora_b.shape == (3, 12, 8)
    assert layer.lora_b.transpose(1, 2).is_contiguous()  # the CPU kernel reads it without a copy
    layer.set_slot(1, [torch.randn(4, 16), None], [torch.ones(8, 4), None])
    assert layer.lora_b[1, :8, :4].eq(1).all() and layer.lora_b[1, 8:].eq(0).all() and layer.lora_b[1, :, 4:].eq(0).all()
    assert layer.slot_ranks.tolist() == [0, 4, 0]


def test_no_mapping_is_the_base_layer():
    base = nn.Linear(8, 8)
    x = torch.randn(5, 8)
    assert torch.equal(make(base)(x), base(x))


def test_packed_layer_equals_separate_layers_and_missing_parts_stay_zero():
    torch.manual_seed(0)
    sizes = (8, 4, 4)
    fused = nn.Linear(16, sum(sizes), bias=False)
    packed = make(fused, cls=PackedLoRALinear, output_slices=sizes)
    parts = [(torch.randn(r, 16), torch.randn(n, r)) for r, n in zip((2, 8, 5), sizes)]
    packed.set_slot(1, [parts[0][0], None, parts[2][0]], [parts[0][1], None, parts[2][1]], [2.0, 1.0, 0.25])
    x = torch.randn(4, 16)
    packed.context.mapping = LoRAMapping.from_slots([1] * 4)
    y = packed(x)
    q, k, v = fused(x).split(sizes, dim=1)
    torch.testing.assert_close(y[:, :8], q + 2.0 * x @ parts[0][0].t() @ parts[0][1].t())
    torch.testing.assert_close(y[:, 8:12], k)
    torch.testing.assert_close(y[:, 12:], v + 0.25 * x @ parts[2][0].t() @ parts[2][1].t())


@pytest.mark.parametrize(
    "a_shape, b_shape, words",
    [((9, 16), (12, 9), ["rank 9", "max_lora_rank=8"]), ((4, 15), (12, 4), ["(4, 15)", "[r, 16]"]),
     ((4, 16), (11, 4), ["(11, 4)", "[12, r]"])],
)
def test_set_slot_refuses_bad_shapes(a_shape, b_shape, words):
    layer = make(nn.Linear(16, 12))
    with pytest.raises(ValueError) as err:
        layer.set_slot(0, torch.zeros(a_shape), torch.zeros(b_shape))
    assert all(w in str(err.value) for w in words)


def test_slot_ranks_track_the_largest_real_rank_per_slot():
    sizes = (8, 4, 4)
    packed = make(nn.Linear(16, 16, bias=False), cls=PackedLoRALinear, output_slices=sizes)
    packed.set_slot(0, [torch.randn(2, 16), None, torch.randn(5, 16)], [torch.randn(8, 2), None, torch.randn(4, 5)])
    packed.set_slot(1, [torch.randn(8, 16), None, None], [torch.randn(8, 8), None, None])
    assert packed.slot_ranks.tolist() == [5, 8, 0]
    packed.set_slot(1, [None, torch.randn(3, 16), None], [None, torch.randn(4, 3), None])  # rewrite: not a max
    packed.clear_slot(0)
    assert packed.slot_ranks.tolist() == [0, 3, 0]


def test_hooks_run_unless_the_layer_is_called_directly():
    """In a plain HF model the LoRA layer keeps nn.Module's call, so users' hooks run; inside the engine's own
    modules (layers.DirectCall; the LoRAManager sets direct_call) it calls forward without the dispatch."""
    calls = []
    layer = make(nn.Linear(8, 4))
    layer.register_forward_hook(lambda *_: calls.append("hook"))
    y = layer(torch.randn(2, 8))
    assert calls == ["hook"] and not layer.direct_call
    layer.direct_call = True
    assert torch.equal(layer(torch.ones(2, 8)), layer.forward(torch.ones(2, 8))) and calls == ["hook"]
    assert y.shape == (2, 4)


def test_a_slot_rewritten_holds_only_the_new_adapter_and_a_part_that_does_not_fit_writes_nothing():
    """Slot writes are gathered (SlotWrites) and skip the zero fill when every slice is at max rank: what a
    lower-rank or partial adapter does not cover must still read zero after a full one, and a refused part
    must leave the slot as it was."""
    sizes = (8, 4)
    packed = make(nn.Linear(16, 12, bias=False), cls=PackedLoRALinear, output_slices=sizes)
    packed.set_slot(1, [torch.ones(8, 16), torch.ones(8, 16)], [torch.ones(8, 8), torch.ones(4, 8)])
    assert packed.lora_a[1].eq(1).all() and packed.lora_b[1].eq(1).all()
    a, b = torch.full((3, 16), 2.0), torch.full((8, 3), 2.0)
    packed.set_slot(1, [a, None], [b, None])
    assert packed.lora_a[1, :3].eq(2).all() and packed.lora_a[1, 3:].eq(0).all()
    assert packed.lora_b[1, :8, :3].eq(2).all() and packed.lora_b[1, :8, 3:].eq(0).all() and packed.lora_b[1, 8:].eq(0).all()
    before = packed.lora_a.clone(), packed.lora_b.clone(), packed.slot_ranks.clone()
    with pytest.raises(ValueError, match="max_lora_rank"):
        packed.set_slot(1, [torch.ones(8, 16), torch.ones(9, 16)], [torch.ones(8, 8), torch.ones(4, 9)])
    assert all(torch.equal(x, y) for x, y in zip(before, (packed.lora_a, packed.lora_b, packed.slot_ranks)))


def test_slot_writes_follow_buffers_that_were_replaced():
    layer = make(nn.Linear(16, 12))
    layer.set_slot(0, torch.ones(8, 16), torch.ones(12, 8))
    layer.to(torch.float64)  # new buffers: views made of the old ones would write where no forward pass reads
    layer.set_slot(0, torch.full((8, 16), 3.0), torch.ones(12, 8))
    assert layer.lora_a.dtype == torch.float64 and layer.lora_a[0].eq(3).all()


def test_a_head_slot_rewritten_drops_the_whole_copy_the_slot_held():
    head = make(nn.Linear(16, 12), cls=LoRAHead)
    head.set_copy(1, torch.ones(12, 16))
    head.set_slot(1, torch.ones(8, 16), torch.ones(12, 8))
    assert 1 not in head.copies


def test_a_saved_head_picks_its_rows_from_the_hosts_slots_without_reading_the_device(monkeypatch):
    """The engine's head mapping carries its rows' slots on the host (LoRAMapping.from_host): the saved copy's
    rows are picked there, with the result of the device's pick (an HF model's mapping has no host list)."""
    torch.manual_seed(1)
    head = make(nn.Linear(8, 20, bias=False), cls=LoRAHead)
    head.set_slot(1, torch.randn(4, 8), torch.randn(20, 4), scaling=0.5)
    head.set_copy(0, torch.randn(20, 8))
    x, slots = torch.randn(5, 8), [0, -1, 1, 0, 2]
    head.context.mapping = LoRAMapping.from_slots(slots)
    on_device = head(x)
    head.context.mapping = LoRAMapping.from_host(slots)
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda *a, **k: pytest.fail("read the device"))
    torch.testing.assert_close(head(x), on_device)
    assert torch.equal(on_device[[0, 3]], x[[0, 3]] @ head.copies[0].t())
