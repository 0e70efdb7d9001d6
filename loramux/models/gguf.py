"""GGUF files read tensor by tensor (gguf-py): the quantized tensors loramux's kernels run are kept as their
raw blocks (ops.quant_torch.QuantizedWeight), the others are dequantized to float32.

Names map to HF's with gguf-py's own table (as transformers does), and llama.cpp's row permutation of
q/k in "llama" files (its converter interleaves the rotary halves) is undone on the raw rows, which stay
whole blocks. The config and tokenizer come from transformers' GGUF support.

gguf-py's reader parses every metadata field (a 49k vocabulary: ~2.5 s) and the names need the HF model's
parameter list (~1 s of imports): both are done once per file and kept as a tensor index (each tensor's
type, place and shape in the file, and its HF name); a later read maps the file and takes the tensors from it.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from loramux.ops.quant_torch import GGUF_FORMATS, QuantizedWeight

logger = logging.getLogger(__name__)
PLAIN_TYPES = ("F32", "F16", "BF16")


@dataclass
class GGUFTensors:
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # HF name -> float32 tensor
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # HF name -> raw blocks
    dequantized_types: set[str] = field(default_factory=set)  # quantized types no kernel runs


@dataclass
class _Tensor:
    """One tensor of the file as gguf-py's reader gives it (data: a view of the mapped file), with its HF name."""
    name: str
    hf_name: str | None
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest dimension first
    data: np.ndarray


def gguf_index(path: str, hf_config, index_file: str | None = None) -> dict:
    """The file's tensor index: {"arch", "tensors": [{name, hf_name, type, shape, offset, dtype, data_shape}]},
    read from index_file when it is there, else built with gguf-py's reader (and saved there, atomically)."""
    if index_file is not None and os.path.isfile(index_file):
        try:
            with open(index_file) as f:
                return json.load(f)
        except ValueError:  # not written by this code (whose writes are atomic): made again below
            logger.warning("GGUF tensor index %s is not valid JSON; reading %s again", index_file, path)
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    names = _gguf_to_hf_names(hf_config, arch)
    index = {"arch": arch, "tensors": [
        {"name": t.name, "hf_name": names.get(t.name), "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
         "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
        for t in reader.tensors]}
    if index_file is not None:
        tmp = f"{index_file}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, index_file)  # whole or not at all: another process may read it
    return index


def _mapped_tensors(path: str, index: dict) -> list[_Tensor]:
    from gguf import GGMLQuantizationType

    file = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for e in index["tensors"]:
        dtype, shape = np.dtype(e["dtype"]), tuple(e["data_shape"])
        data = file[e["offset"]:e["offset"] + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        tensors.append(_Tensor(e["name"], e["hf_name"], GGMLQuantizationType[e["type"]], tuple(e["shape"]), data))
    return tensors


def read_gguf_tensors(path: str, hf_config, keep_quantized: bool, index_file: str | None = None) -> GGUFTensors:
    """Every tensor of the file under its HF name; keep_quantized: the types of GGUF_FORMATS stay raw.
    index_file: where the file's tensor index is kept (see gguf_index)."""
    index = gguf_index(path, hf_config, index_file)
    arch = index["arch"]
    out = GGUFTensors()
    for tensor in _mapped_tensors(path, index):
        hf_name = tensor.hf_name
        if hf_name is None:
            logger.info("GGUF tensor %s has no place in the model; skipped", tensor.name)
            continue
        rows = _row_order(hf_name, hf_config) if arch == "llama" else None
        kind = tensor.tensor_type.name
        if keep_quantized and kind.lower() in GGUF_FORMATS and len(tensor.shape) == 2:
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # a copy: the file is memory-mapped
            if rows is not None:
                data = data[rows].contiguous()
            k, n = (int(d) for d in tensor.shape)  # GGUF lists the fastest dimension first
            out.quantized[hf_name] = QuantizedWeight(kind.lower(), data, n, k)
            continue
        if kind not in PLAIN_TYPES:
            out.dequantized_types.add(kind)
        values = torch.from_numpy(_dequantize(tensor).copy()).float()  # (a copy: the file is memory-mapped)
        out.state[hf_name] = values[rows].contiguous() if rows is not None else values
    if out.dequantized_types and keep_quantized:
        logger.warning("GGUF tensor types %s have no kernel here: those tensors were dequantized (kept quantized: "
                       "%s)", ", ".join(sorted(out.dequantized_types)), ", ".join(f.upper() for f in GGUF_FORMATS))
    return out


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def _field(reader, key: str) -> str:
    f = reader.fields[key]
    return bytes(f.parts[f.data[0]]).decode()


def _gguf_to_hf_names(hf_config, arch: str) -> dict[str, str]:
    """{GGUF tensor name: HF parameter name} for every parameter of the HF model of this config."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    gguf_arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if gguf_arch is None:
        raise ValueError(f"GGUF architecture {arch!r} is not known to gguf-py")
    table = get_tensor_name_map(gguf_arch, hf_config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = list(AutoModelForCausalLM.from_config(hf_config).state_dict())
    names = {}
    for hf_name in hf_names:
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(module)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _row_order(hf_name: str, hf_config) -> torch.Tensor | None:
    """For q_proj / k_proj of a "llama" GGUF: the file's row for each HF row (llama.cpp's converter permutes
    them: reshape(heads, 2, dim, ...).swapaxes(1, 2); transformers' loader undoes it the same way)."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads or hf_config.num_attention_heads
    if ".q_proj." in hf_name:
        n_head = heads
    elif ".k_proj." in hf_name:
        n_head = kv_heads
    else:
        return None
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    n = n_head * head_dim
    return torch.arange(n).reshape(n_head, head_dim // 2, 2).transpose(1, 2).reshape(n)

