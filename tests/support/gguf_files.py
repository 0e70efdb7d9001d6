"""Tiny GGUF files written here with gguf-py (as llama.cpp's converter writes them: q/k rows permuted, a
byte-level BPE vocabulary), so that loaders can be checked against transformers' own GGUF loader. K-quant
tensors (gguf-py cannot quantize to them) are random blocks with realistic scales."""
from __future__ import annotations

import numpy as np

GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rotary halves interleaved, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks [rows, cols / 256 * block_bytes] whose fp16 scales are small and finite."""
    import gguf

    rng = np.random.default_rng(seed)
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // elems, size), dtype=np.uint8)
    scales = lambda: rng.uniform(-0.004, 0.004, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    if qtype.name == "Q6_K":
        blocks[:, 208:210] = scales()
    else:  # Q4_K, Q5_K: d, dmin
        blocks[:, 0:2], blocks[:, 2:4] = scales(), scales()
    return blocks.reshape(rows, -1)


def write_gguf(model, path: str, type_of) -> str:
    """model: an HF Llama; type_of(gguf tensor name, 2-D?) -> one of GGUF_TYPES for that tensor."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(33, 30 + cfg.vocab_size)]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    state = model.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # llama.cpp writes a tied head once, as the embedding
    for i, (hf_name, tensor) in enumerate(state.items()):
        module, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(module)}.{suffix}"
        a = tensor.float().numpy()
        if ".q_proj." in hf_name:
            a = _permute(a, cfg.num_attention_heads)
        elif ".k_proj." in hf_name:
            a = _permute(a, cfg.num_key_value_heads)
        kind = getattr(T, type_of(name, a.ndim == 2) if a.ndim == 2 else "F32")
        if kind in (T.F32, T.F16):
            writer.add_tensor(name, a.astype(np.float32 if kind == T.F32 else np.float16))
        elif kind in (T.Q4_K, T.Q5_K, T.Q6_K):
            blocks = random_blocks(kind, *a.shape, seed=i)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            q = gguf.quants.quantize(a, kind)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
