"""The rotary table against HF transformers' own rotary classes, for every RoPE type its models use."""
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from loramux.layers.rotary import hf_rotary

HEAD = 16  # hidden 64 / 4 heads
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + i / 8 for i in range(HEAD // 2)], "long_factor": [2.0 + i for i in range(HEAD // 2)]},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("positions", [48, 160])  # within max_position_embeddings (64), and past it
def test_the_table_equals_hf_llamas_rotary_class(rope, positions):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                         rope_parameters=dict(ROPES[rope]))
    probe, ids = torch.empty(0), torch.arange(positions)[None]
    ours, theirs = hf_rotary(config, "cpu")(probe, ids), LlamaRotaryEmbedding(config)(probe, ids)
    for a, b in zip(ours, theirs):
        assert a.shape == (1, positions, HEAD) and torch.equal(a, b)


def test_a_head_dim_of_its_own_as_qwen3s_rotary_class():
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=64)
    probe, ids = torch.empty(0), torch.arange(64)[None]
    for a, b in zip(hf_rotary(config, "cpu")(probe, ids), Qwen3RotaryEmbedding(config)(probe, ids)):
        assert a.shape == (1, 64, 32) and torch.equal(a, b)


def test_loading_a_model_imports_no_modeling_module_and_not_torch_dynamo(tmp_path):
    """Both cost seconds of every engine start (transformers' modeling stack; dynamo through a meta tensor's
    random init)."""
    from conftest import save_checkpoint, tiny_llama

    path = save_checkpoint(tiny_llama(), tmp_path / "model")
    code = ("import re, sys; from loramux.models.loader import load_model; load_model(sys.argv[1], dtype='float32'); "
            "print(sorted(m for m in sys.modules if re.match(r'torch\\._dynamo|transformers\\.modeling_utils|"
            "transformers\\.models\\.\\w+\\.modeling_(?!auto)', m)))")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
