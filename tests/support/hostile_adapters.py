"""A generated corpus of broken and hostile adapter directories, each with the words its refusal must hold.

Used through the Python API (tests/adapters/test_hostile_adapters.py) and the HTTP API
(tests/server/test_server.py): every case is refused with a clear message, nothing else changes.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

ST, CONFIG = "adapter_model.safetensors", "adapter_config.json"
KEY_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
KEY_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    words: str  # in the refusal's message through the Python API (and the HTTP API unless http_words)
    http_words: str | None = None  # where the HTTP front end's own path check answers first

    @property
    def http(self) -> str:
        return self.http_words or self.words


def _copy(good: str, root: str, case: str) -> str:
    path = os.path.join(root, case)
    shutil.copytree(good, path)
    return path


def _header(path: str) -> tuple[dict, bytes]:
    data = open(os.path.join(path, ST), "rb").read()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def _write_header(path: str, header_text: str, body: bytes) -> None:
    raw = header_text.encode()
    with open(os.path.join(path, ST), "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + body)


def _edit_tensors(path: str, edit) -> None:
    tensors = load_file(os.path.join(path, ST))
    edit(tensors)
    save_file(tensors, os.path.join(path, ST))


def _edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, CONFIG)) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f)  # NaN / Infinity written as JSON's common extensions, as Python writes them


_DROP = object()


def _set(key: str, transform):
    def edit(tensors):
        tensors[key] = transform(tensors[key])
    return edit


def build_corpus(good: str, root: str, outside: str) -> list[Case]:
    """good: a valid adapter directory; root: the allowed directory to build cases in; outside: a directory
    outside it (a valid adapter is copied there as the target of escapes)."""
    os.makedirs(root, exist_ok=True)
    target = shutil.copytree(good, os.path.join(outside, "target"), dirs_exist_ok=True)
    cases = []

    def tensors(case, edit, words):
        path = _copy(good, root, case)
        _edit_tensors(path, edit)
        cases.append(Case(case, path, words))

    def config(case, words, **changes):
        path = _copy(good, root, case)
        _edit_config(path, **changes)
        cases.append(Case(case, path, words))

    def raw(case, writer, words):
        path = _copy(good, root, case)
        writer(path)
        cases.append(Case(case, path, words))

    header, body = _header(good)
    first = next(k for k in header if k != "__metadata__")

    # safetensors files: truncated, corrupt headers and offsets
    raw("truncated-8", lambda p: _truncate(p, 5), "not a safetensors file")
    raw("truncated-data", lambda p: _truncate(p, os.path.getsize(os.path.join(p, ST)) - 100), "safetensors")
    raw("length-huge", lambda p: _write_raw(p, (10**15).to_bytes(8, "little") + b"{}"), "not a safetensors file")
    raw("length-zero", lambda p: _write_raw(p, (0).to_bytes(8, "little") + b"{}"), "not a safetensors file")
    raw("header-not-json", lambda p: _write_header(p, "{nope", body), "malformed safetensors header")
    raw("header-array", lambda p: _write_header(p, "[1, 2]", body), "malformed safetensors header")
    raw("header-duplicate", lambda p: _write_header(p, json.dumps(header)[:-1] + f', "{first}": '
                                                    + json.dumps(header[first]) + "}", body), "duplicate keys")
    raw("offsets-past-end", lambda p: _write_header(p, json.dumps(_shift(header, first, 10**9)), body), "safetensors")
    raw("offsets-overlap", lambda p: _write_header(p, json.dumps(_overlap(header)), body), "safetensors")
    raw("header-garbage-bytes", lambda p: _write_raw(p, (4).to_bytes(8, "little") + b"\xff\xfe\x00\x01" + body),
        "malformed safetensors header")
    # tensors: dtypes, values, shapes, ranks
    for dtype in ("int8", "int64", "bool", "float64"):
        tensors(f"dtype-{dtype}", _set(KEY_A, lambda t, d=dtype: t.to(getattr(torch, d))), f"is {dtype}")
    tensors("nan", _set(KEY_B, lambda t: t.index_fill(1, torch.tensor([0]), float("nan"))), "NaN")
    tensors("inf", _set(KEY_A, lambda t: t.index_fill(1, torch.tensor([0]), float("inf"))), "Inf")
    tensors("huge-1e18", _set(KEY_B, lambda t: t * 1e18), "|values| up to")
    tensors("shape-a", _set(KEY_A, lambda t: t[:, :-3].contiguous()), "the model needs lora_A")
    tensors("transposed-b", _set(KEY_B, lambda t: t.t().contiguous()), "the model needs lora_A")
    tensors("rank-zero", lambda ts: ts.update({KEY_A: ts[KEY_A][:0].contiguous(), KEY_B: ts[KEY_B][:, :0].contiguous()}),
            "rank 0 in its weights")
    tensors("only-a", lambda ts: ts.pop(KEY_B), "lora_A but not its pair")
    config_r40 = lambda ts: ts.update({k: torch.cat([t] * 5, dim=0 if "lora_A" in k else 1).contiguous()
                                        for k, t in ts.items()})  # rank 8 -> 40, above max_lora_rank=32
    rank40 = _copy(good, root, "rank-above-max")
    _edit_tensors(rank40, config_r40)
    _edit_config(rank40, r=40)
    cases.append(Case("rank-above-max", rank40, "above max_lora_rank=32"))
    unknown = _copy(good, root, "unknown-module")
    _edit_tensors(unknown, lambda ts: ts.update({KEY_A.replace("q_proj", "foo_proj"): ts[KEY_A].clone(),
                                                 KEY_B.replace("q_proj", "foo_proj"): ts[KEY_B].clone()}))
    _edit_config(unknown, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "foo_proj"])
    cases.append(Case("unknown-module", unknown, "does not have"))
    tensors("embedding-lora", lambda ts: ts.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                                                    torch.zeros(8, 128)}), "lora_embedding_A")
    tensors("empty-file", lambda ts: ts.clear(), "no LoRA weights")
    # configs
    config("r-zero", "r must be a positive integer, got 0", r=0)
    config("r-negative", "r must be a positive integer, got -8", r=-8)
    config("r-float", "r must be a positive integer, got 8.7", r=8.7)
    config("r-string", "r must be a positive integer", r="8")
    config("r-missing", "missing field 'r'", r=_DROP)
    config("r-disagrees", "in its weights but 4 in adapter_config.json", r=4)
    config("targets-missing", "target_modules is missing", target_modules=_DROP)
    config("targets-int", "target_modules must be a list of module names or a regex string", target_modules=5)
    config("targets-bad-regex", "not a valid regular expression", target_modules="q_proj(")
    config("alpha-nan", "lora_alpha must be a finite number", lora_alpha=float("nan"))
    config("alpha-inf", "lora_alpha must be a finite number", lora_alpha=float("inf"))
    config("alpha-huge", "scaling 1.25e+29 folded in", lora_alpha=1e30)  # finite, but scales B past any trained value
    config("rank-pattern-zero", "rank_pattern['q_proj'] must be a positive integer", rank_pattern={"q_proj": 0})
    config("dora", "DoRA", use_dora=True)
    config("peft-type", "peft_type='IA3'", peft_type="IA3")
    raw("config-not-json", lambda p: _write_text(p, CONFIG, "{not json"), "not valid JSON")
    raw("config-array", lambda p: _write_text(p, CONFIG, "[]"), "expected a JSON object")
    raw("config-binary", lambda p: _write_raw_file(p, CONFIG, b"\xff\xfe\x00garbage"), "not valid JSON")
    # directories and paths
    empty = os.path.join(root, "empty")
    os.makedirs(empty)
    cases.append(Case("empty-dir", empty, "has no adapter_config.json"))
    unrelated = os.path.join(root, "unrelated")
    os.makedirs(unrelated)
    _write_text(unrelated, "README.md", "# my notes\n")
    cases.append(Case("unrelated-dir", unrelated, "has no adapter_config.json"))
    only_config = os.path.join(root, "only-config")
    os.makedirs(only_config)
    shutil.copy(os.path.join(good, CONFIG), only_config)
    cases.append(Case("only-config", only_config, "adapter_model.safetensors"))
    cases.append(Case("path-is-a-file", os.path.join(root, "only-config", CONFIG), "is a file"))
    st_dir = _copy(good, root, "weights-is-a-dir")
    os.remove(os.path.join(st_dir, ST))
    os.makedirs(os.path.join(st_dir, ST))
    cases.append(Case("weights-is-a-dir", st_dir, "is not a regular file"))
    escape = os.path.join(root, "escape-dir")
    os.symlink(target, escape)
    cases.append(Case("symlink-dir-escape", escape, "outside the allowed"))
    cases.append(Case("dotdot-escape", os.path.join(root, os.path.relpath(target, root)), "outside the allowed"))
    linked = os.path.join(root, "file-symlink-escape")
    os.makedirs(linked)
    shutil.copy(os.path.join(good, CONFIG), linked)
    os.symlink(os.path.join(target, ST), os.path.join(linked, ST))
    cases.append(Case("file-symlink-escape", linked, "outside the allowed adapter directories"))
    dev_zero = os.path.join(root, "dev-zero")
    os.makedirs(dev_zero)
    shutil.copy(os.path.join(good, CONFIG), dev_zero)
    os.symlink("/dev/zero", os.path.join(dev_zero, ST))
    cases.append(Case("weights-dev-zero", dev_zero, "outside the allowed adapter directories"))
    sparse = _copy(good, root, "sparse-2gb")
    with open(os.path.join(sparse, ST), "r+b") as f:
        f.truncate(2 << 30)  # nothing allocated, and nothing may be read
    cases.append(Case("sparse-2gb", sparse, "bytes; LoRA weights for this model"))
    evil = os.path.join(root, "pickle-reduce")
    os.makedirs(evil)
    shutil.copy(os.path.join(good, CONFIG), evil)
    _write_evil_pickle(os.path.join(evil, "adapter_model.bin"), os.path.join(outside, "pwned"))
    cases.append(Case("pickle-reduce", evil, "refusing to unpickle", "only safetensors"))
    return cases


BAD_NAMES = ["x=/elsewhere/e", "/etc/passwd", "a,b", "../up", "bell\x07", "tab\tname", "é", "x" * 129, ".hidden"]


def _truncate(path: str, size: int) -> None:
    with open(os.path.join(path, ST), "r+b") as f:
        f.truncate(size)


def _write_raw(path: str, data: bytes) -> None:
    _write_raw_file(path, ST, data)


def _write_raw_file(path: str, name: str, data: bytes) -> None:
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)


def _write_text(path: str, name: str, text: str) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(text)


def _shift(header: dict, key: str, by: int) -> dict:
    header = json.loads(json.dumps(header))
    begin, end = header[key]["data_offsets"]
    header[key]["data_offsets"] = [begin + by, end + by]
    return header


def _overlap(header: dict) -> dict:
    header = json.loads(json.dumps(header))
    keys = [k for k in header if k != "__metadata__"]
    header[keys[1]]["data_offsets"] = list(header[keys[0]]["data_offsets"])
    return header


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _write_evil_pickle(file: str, marker: str) -> None:
    torch.save({KEY_A: _Evil(marker)}, file)
