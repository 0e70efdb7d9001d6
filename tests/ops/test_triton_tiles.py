"""The Triton kernels' tiles and splits (ops/triton_tiles.py): defaults, a GPU's measured table, and the split
rule, all from shapes alone."""
import json

import pytest

from loramux.ops import triton_tiles
from loramux.ops.triton_tiles import MAX_SPLITS, AttentionTiles, LoRATiles, splits


def test_splits_fill_the_gpu_only_where_the_grid_does_not():
    assert splits(programs=3, sms=132, length=2048, min_piece=256) == 8  # batch-1 qkv shrink: 2048 / 256 pieces
    assert splits(programs=1, sms=132, length=8192, min_piece=256) == MAX_SPLITS
    assert splits(programs=8, sms=132, length=512, min_piece=256) == 2
    assert splits(programs=40, sms=132, length=8192, min_piece=256) == 4  # ceil(132 / 40)
    assert splits(programs=132, sms=132, length=8192, min_piece=256) == 1  # the grid fills it
    assert splits(programs=3, sms=132, length=100, min_piece=256) == 1  # too short to cut
    assert splits(programs=3, sms=1, length=8192, min_piece=256) == 1  # the interpreter's one "SM"


def test_off_cuda_the_defaults_and_one_sm():
    assert triton_tiles.gpu_name("cpu") == "" and triton_tiles.multiprocessors("cpu") == 1
    assert triton_tiles.lora_tiles("cpu", 7) == LoRATiles()
    assert triton_tiles.attention_tiles("cpu", 7) == AttentionTiles()


def test_a_measured_table_overrides_the_defaults_by_size(tmp_path, monkeypatch):
    table = {"lora": {"1": {"block_k": 128, "split_min_k": 512}, "64": {"block_m": 32}},
             "attention": {"8": {"split_min_len": 128}}}
    (tmp_path / "some_gpu.json").write_text(json.dumps(table))
    monkeypatch.setattr(triton_tiles, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(triton_tiles, "gpu_name", lambda device: "some_gpu")
    triton_tiles.tuned_table.cache_clear()
    try:
        assert triton_tiles.lora_tiles("cuda", 1) == LoRATiles(block_k=128, split_min_k=512)
        assert triton_tiles.lora_tiles("cuda", 2) == LoRATiles(block_m=32)  # the smallest bound >= 2
        assert triton_tiles.lora_tiles("cuda", 4096) == LoRATiles(block_m=32)  # past every bound: the largest
        assert triton_tiles.attention_tiles("cuda", 1) == AttentionTiles(split_min_len=128)
        (tmp_path / "some_gpu.json").write_text(json.dumps({"lora": {"1": {"block_q": 1}}}))
        triton_tiles.tuned_table.cache_clear()
        with pytest.raises(TypeError, match="block_q"):  # a field the kernels do not have is named
            triton_tiles.lora_tiles("cuda", 1)
    finally:
        triton_tiles.tuned_table.cache_clear()
