"""Reading adapters from disk, safely: a PEFT adapter directory, or one .safetensors file of LoRA pairs.

Every file read resolves (symlinks and `..` followed) inside the allowed directories when some are given,
and is opened once: what was checked is what is read (read_bytes). Its size is bounded before it is read;
a safetensors header is checked before any tensor is read; pickle is read only when asked, and then with
weights_only. What comes back is (PEFT config, tensors), for adapters/checkpoint.py to check against the
model; read_adapter adds a digest of every byte read, which says whether two reads saw the same adapter.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
import time
from typing import NamedTuple

import torch

from loramux.adapters.checkpoint import config_from_tensors
from loramux.adapters.file_names import CONFIG_FILE, MAX_CONFIG_BYTES, PICKLE_FILE, SAFETENSORS_FILE
from loramux.adapters.peft_config import InvalidAdapterError

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
# No symlink followed at the last component (one put there after the path was resolved), and no wait on a FIFO.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class AdapterPathError(FileNotFoundError):
    """The path is not a readable adapter, or leads outside the allowed directories."""


class AdapterFiles(NamedTuple):
    config: dict
    tensors: dict[str, torch.Tensor]
    digest: str  # of the names and bytes of every file read: equal digests, the same adapter ("": not taken)


def read_adapter(path: str, allow_pickle: bool = False, allowed_dirs: tuple[str, ...] = (),
                 max_weight_bytes: int | None = None, lora_alpha: float | None = None,
                 digest: bool = True) -> AdapterFiles:
    """A PEFT adapter directory, or a lone `.safetensors` file (read_adapter_file; lora_alpha is for it).
    digest False: no digest ("", a quarter of a read's CPU), for a read whose files are known unchanged."""
    seen = hashlib.sha256() if digest else None  # (with SHA extensions ~2x blake2b's speed: ~5 ms for 10 MB)
    if _lone_file(path):
        config, tensors = read_adapter_file(path, lora_alpha, allowed_dirs, max_weight_bytes, seen)
    elif lora_alpha is not None:
        raise InvalidAdapterError(f"lora_alpha is for a lone .safetensors file; the adapter directory {path!r} "
                                  f"says its own in {CONFIG_FILE}")
    else:
        config, tensors = read_adapter_dir(path, allow_pickle, allowed_dirs, max_weight_bytes, seen)
    return AdapterFiles(config, tensors, seen.hexdigest() if seen is not None else "")


class Signature(NamedTuple):
    """How the files an adapter is read from looked at one moment: per file (files_of), its (size, mtime_ns,
    ctime_ns, inode, device), None where absent; and when that was (wall clock, ns)."""

    stats: tuple
    taken_ns: int


RACY_NS = 2_000_000_000
"""A file changed this close to the moment its signature was taken may change again within the same tick of the
file system's clock and look the same (git's "racily clean" files): such a signature is never trusted."""


def signature(path: str) -> Signature:
    """A cheap look (stat) at the files an adapter at `path` is read from. ctime is in it because nothing can set
    it back: a rewrite that restores size and mtime (cp -p, rsync -t) still shows."""
    taken = time.time_ns()
    stats = []
    for name in files_of(path):
        try:
            info = os.stat(name)
        except (OSError, ValueError):
            stats.append(None)
            continue
        stats.append((info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev))
    return Signature(tuple(stats), taken)


def files_of(path: str) -> tuple[str, ...]:
    """The files a read of the adapter at `path` may read."""
    if path.endswith(".safetensors"):
        return path, path.removesuffix(".safetensors") + ".json", os.path.join(os.path.dirname(path), CONFIG_FILE)
    return tuple(os.path.join(path, n) for n in (CONFIG_FILE, SAFETENSORS_FILE, PICKLE_FILE))


def unchanged(now: Signature, then: Signature | None) -> bool:
    """Whether files whose signature was `then` look the same `now`, and `then` is one to trust: every file
    present, none changed within RACY_NS before `then` was taken."""
    if then is None or now.stats != then.stats or not any(then.stats):
        return False
    return all(stat is None or stat[2] < then.taken_ns - RACY_NS for stat in then.stats)


def _lone_file(path) -> bool:
    """Whether `path` names a lone .safetensors file of LoRA pairs (read_adapter_file), not a directory."""
    return isinstance(path, str) and path.endswith(".safetensors") and os.path.isfile(path)


def _sidecar(path: str) -> str:
    """A lone file's PEFT config, where there is one: x.json beside x.safetensors, or the directory's
    adapter_config.json beside an adapter_model.safetensors."""
    if path.endswith(SAFETENSORS_FILE):
        return os.path.join(os.path.dirname(path), CONFIG_FILE)
    return path.removesuffix(".safetensors") + ".json"


def digest_adapter(path: str, allow_pickle: bool = False, allowed_dirs: tuple[str, ...] = (),
                   max_weight_bytes: int | None = None) -> str:
    """read_adapter's digest of the adapter at `path`, from the same files read the same way, but nothing parsed
    or built (about a third of a read's CPU): whether the files still hold what an earlier read saw."""
    seen = hashlib.sha256()
    if _lone_file(path):
        read_bytes(path, allowed_dirs, max_weight_bytes, seen)
        if os.path.lexists(sidecar := _sidecar(path)):
            read_bytes(sidecar, allowed_dirs, MAX_CONFIG_BYTES, seen)
        return seen.hexdigest()
    _check_dir(path)
    read_bytes(os.path.join(path, CONFIG_FILE), allowed_dirs, MAX_CONFIG_BYTES, seen)
    weights = os.path.join(path, SAFETENSORS_FILE)
    if not os.path.lexists(weights) and allow_pickle:
        weights = os.path.join(path, PICKLE_FILE)
    read_bytes(weights, allowed_dirs, max_weight_bytes, seen)
    return seen.hexdigest()


def read_adapter_dir(path: str, allow_pickle: bool = False, allowed_dirs: tuple[str, ...] = (),
                     max_weight_bytes: int | None = None, seen=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read adapter_config.json and the weights. Pickle only when asked, and then weights_only.

    allowed_dirs: when given, every file read must resolve (symlinks and `..` followed) inside one of them.
    max_weight_bytes: a weights file larger than this is refused before it is read. seen: a hashlib object
    that every file's name and bytes update."""
    _check_dir(path)
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.lexists(config_path):
        raise AdapterPathError(f"adapter path {path!r} has no {CONFIG_FILE}")
    config = _read_config(config_path, path, allowed_dirs, seen)
    return config, _read_weights(path, allow_pickle, allowed_dirs, max_weight_bytes, seen)


def read_adapter_file(path: str, lora_alpha: float | None = None, allowed_dirs: tuple[str, ...] = (),
                      max_weight_bytes: int | None = None, seen=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """One .safetensors file of LoRA pairs (TensorRT Edge-LLM's loadWeights(name, file)). Its PEFT config is
    a sidecar when there is one (`x.json` beside `x.safetensors`; the directory's adapter_config.json beside
    an adapter_model.safetensors) or else made from the tensors (config_from_tensors: rank per module from
    the shapes, targets from the names, lora_alpha from the caller). A caller's lora_alpha that differs from
    a sidecar's is refused: which one holds is not clear."""
    tensors = _read_safetensors(path, allowed_dirs, max_weight_bytes, seen)
    sidecar = _sidecar(path)
    if not os.path.lexists(sidecar):
        return config_from_tensors(tensors, lora_alpha, path), tensors
    config = _read_config(sidecar, path, allowed_dirs, seen)
    if lora_alpha is not None and config.get("lora_alpha") != lora_alpha:
        raise InvalidAdapterError(f"lora_alpha={lora_alpha} given for {path}, but its config {sidecar} says "
                                  f"lora_alpha={config.get('lora_alpha')}: give one of them")
    return config, tensors


def _read_config(config_path: str, path: str, allowed_dirs: tuple[str, ...] = (), seen=None) -> dict:
    data = read_bytes(config_path, allowed_dirs, MAX_CONFIG_BYTES, seen)
    try:
        config = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAdapterError(f"{CONFIG_FILE} in {path!r}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise InvalidAdapterError(f"{CONFIG_FILE} in {path!r}: expected a JSON object, got {type(config).__name__}")
    return config


# The modules an adapter may have LoRA on that LoRAConfig.target_modules leaves unwrapped by default.
_OPTIONAL_TARGETS = (("embed_tokens", re.compile(r"(^|\.)embed_tokens\.lora_")),
                     ("lm_head", re.compile(r"(^|\.)lm_head\.lora_")),
                     ("experts", re.compile(r"\.experts\.(?:[\w.]+\.)?lora_")))  # per expert, or 3D parameters


def modules_to_wrap(path: str) -> set[str]:
    """Which of embed_tokens, lm_head and experts the adapter at `path` has LoRA on, from its weights file's
    tensor names (its header alone: no tensor is read). An unreadable adapter needs nothing here: its load
    says what is wrong with it."""
    file = path if path.endswith(".safetensors") else os.path.join(path, SAFETENSORS_FILE)
    try:
        with open(file, "rb") as f:
            keys = _read_header(f, os.path.getsize(file), file)
    except (OSError, InvalidAdapterError):
        return set()
    return {target for target, pattern in _OPTIONAL_TARGETS if any(pattern.search(key) for key in keys)}


def _check_dir(path: str) -> None:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise AdapterPathError(f"invalid adapter path {path!r}")
    if not os.path.exists(path):
        raise AdapterPathError(f"adapter path {path!r} does not exist")
    if not os.path.isdir(path):
        raise AdapterPathError(f"adapter path {path!r} is a file; give the adapter's directory (the one that "
                               f"holds {CONFIG_FILE}), or a lone .safetensors file of LoRA pairs")


def _resolve(file: str, allowed_dirs: tuple[str, ...]) -> str:
    """The real path of `file`, refused when it leads outside every allowed directory (checked per file:
    a directory inside may hold a symlink to a file outside)."""
    real = os.path.realpath(file)
    roots = [os.path.realpath(d) for d in allowed_dirs]
    if roots and not any(os.path.commonpath([real, root]) == root for root in roots):
        raise AdapterPathError(f"{file} resolves to {real}, outside the allowed adapter directories "
                               f"({', '.join(roots)})")
    return real


def _read_weights(path: str, allow_pickle: bool, allowed_dirs, max_bytes, seen) -> dict[str, torch.Tensor]:
    st_path, bin_path = os.path.join(path, SAFETENSORS_FILE), os.path.join(path, PICKLE_FILE)
    if os.path.lexists(st_path):
        return _read_safetensors(st_path, allowed_dirs, max_bytes, seen)
    if os.path.lexists(bin_path):
        if not allow_pickle:
            raise InvalidAdapterError(
                f"{bin_path} is a pickle file; refusing to unpickle it. Convert it to "
                f"{SAFETENSORS_FILE}, or pass allow_pickle=True to read it with torch.load(weights_only=True)"
            )
        data = read_bytes(bin_path, allowed_dirs, max_bytes, seen)
        try:
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for bad files
            raise InvalidAdapterError(f"{bin_path}: cannot be read with weights_only=True ({e})") from e
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise InvalidAdapterError(f"{bin_path}: expected a dict of tensors")
        return tensors
    raise AdapterPathError(f"adapter path {path!r} has neither {SAFETENSORS_FILE} nor {PICKLE_FILE}")


def read_bytes(file: str, allowed_dirs: tuple[str, ...] = (), max_bytes: int | None = None, seen=None) -> bytearray:
    """The bytes of `file`, through one descriptor: its real path (inside an allowed directory) opened with no
    symlink followed at its end and no wait on a FIFO, then checked as opened — a regular file, at most
    max_bytes (fstat), and on Linux still inside an allowed directory (a directory swapped for a symlink after
    the check shows there) — and read up to the size seen. seen: updated with the file's name and bytes.
    (A bytearray: tensors can be views of it.)"""
    real = _resolve(file, allowed_dirs)
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except FileNotFoundError:
        raise AdapterPathError(f"{file} does not exist") from None
    except OSError as e:  # ELOOP: the file became a symlink after it was resolved
        raise AdapterPathError(f"{file} cannot be opened as the file it was checked to be ({e.strerror})") from None
    try:
        size = _checked_size(fd, file, allowed_dirs, max_bytes)
    except BaseException:
        os.close(fd)
        raise
    data = bytearray(size)
    with os.fdopen(fd, "rb") as f:
        read = f.readinto(data)
    if read != size:
        raise InvalidAdapterError(f"{file} changed while it was read ({read} of {size} bytes)")
    if seen is not None:
        seen.update(os.path.basename(file).encode() + b"\0" + size.to_bytes(8, "little"))
        seen.update(data)
    return data


def _checked_size(fd: int, file: str, allowed_dirs: tuple[str, ...], max_bytes: int | None) -> int:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise AdapterPathError(f"{file} is not a regular file")
    if allowed_dirs and os.path.isdir("/proc/self/fd"):
        _resolve(os.readlink(f"/proc/self/fd/{fd}"), allowed_dirs)
    if max_bytes is not None and info.st_size > max_bytes:
        kind = "a PEFT config takes" if file.endswith(".json") else \
            "LoRA weights for this model's wrapped modules at max_lora_rank take"
        raise InvalidAdapterError(f"{file} is {info.st_size} bytes; {kind} at most {max_bytes}")
    return info.st_size


def _read_safetensors(file: str, allowed_dirs, max_bytes: int | None, seen=None) -> dict[str, torch.Tensor]:
    """The file read whole (its size is bounded above) and its tensors made views of those bytes: one copy from
    the file, none per tensor (safetensors.torch.load copied each tensor twice more; a read back of an evicted
    adapter is on the loader thread, beside the steps, so its copies cost the steps). The header is checked as
    the safetensors library checks it (a length inside the file, valid JSON, no key twice, known dtypes, each
    tensor's bytes its shape's, the tensors' bytes one after another to the end of the file)."""
    data = read_bytes(file, allowed_dirs, max_bytes, seen)
    length = _header_length(data[:8], len(data), file)  # (slices: a BytesIO of a bytearray copies all of it)
    header = _parse_header(data[8:8 + length], file)
    try:
        return _tensor_views(data, 8 + length, header)
    except ValueError as e:
        raise InvalidAdapterError(f"{file}: unreadable safetensors file ({e})") from e


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _tensor_views(data: bytearray, start: int, header: dict) -> dict[str, torch.Tensor]:
    """Each tensor of the header as a view of data[start:] (a copy where its offset is not a multiple of its
    element size). ValueError naming what does not add up."""
    tensors, spans, size = {}, [], len(data) - start
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = _entry(name, info)
        numel, itemsize = math.prod(shape), dtype.itemsize
        if not 0 <= begin <= end <= size or end - begin != numel * itemsize:
            raise ValueError(f"tensor {name!r}: data offsets [{begin}, {end}] do not hold its {numel} x "
                             f"{itemsize} bytes inside the {size} bytes of data")
        spans.append((begin, end, name))
        aligned = (start + begin) % itemsize == 0
        buffer, offset = (data, start + begin) if aligned else (data[start + begin:start + end], 0)
        tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset).view(shape) if numel \
            else torch.empty(shape, dtype=dtype)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"tensor {name!r} starts at byte {begin} of the data, not {at} (a gap or an overlap)")
        at = end
    if at != size:
        raise ValueError(f"the tensors hold {at} bytes of the {size} bytes of data")
    return tensors


def _entry(name: str, info) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    if not isinstance(info, dict):
        raise ValueError(f"tensor {name!r}: its entry is not an object")
    name_of_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = _DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r}: unknown dtype {name_of_dtype!r}")
    if type(shape) is not list or {type(d) for d in shape} - {int} or (shape and min(shape) < 0):
        raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
    if type(offsets) is not list or len(offsets) != 2 or {type(o) for o in offsets} != {int}:
        raise ValueError(f"tensor {name!r}: bad data_offsets {offsets!r}")
    return dtype, shape, (offsets[0], offsets[1])


def _read_header(f, size: int, file: str) -> dict:
    """A safetensors file's header (f at its start), checked: its length inside the file and the limit, valid
    JSON, an object, no key twice."""
    return _parse_header(f.read(_header_length(f.read(8), size, file)), file)


def _header_length(prefix: bytes, size: int, file: str) -> int:
    """The header's length from a safetensors file's first 8 bytes: inside the file and the limit."""
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
        raise InvalidAdapterError(f"{file}: not a safetensors file (a {size}-byte file whose header length "
                                  f"field reads {length})")
    return length


def _parse_header(raw: bytes, file: str) -> dict:
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAdapterError(f"{file}: malformed safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise InvalidAdapterError(f"{file}: malformed safetensors header (not a JSON object)")
    return header


def _unique_keys(pairs: list) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen = set()
        raise ValueError(f"duplicate keys {sorted({k for k, _ in pairs if k in seen or seen.add(k)})}")
    return result


