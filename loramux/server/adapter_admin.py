"""The adapter admin routes' rules and answers — vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
and /v1/pin_lora_adapter, /v1/unpin_lora_adapter — shared by the single server (app.py) and the Ray Serve
ingress (ray_ingress.py): what a name and a path must be, when a load is a conflict, and the answers' texts.
Status codes follow vLLM's: 400 for a name already loaded from another path (vLLM answers 400 for any
loaded name; loading the same path again succeeds, as MAX's load_adapter does), 404 for an unknown name.
"""
from __future__ import annotations

import os

from fastapi.responses import PlainTextResponse

from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name
from loramux.server import protocol as p
from loramux.server.errors import HTTPError

ADD, REPLACE, AGAIN = "added", "reloaded", "already loaded"  # what a load does (and says it did)


def checked_name(name: str) -> str:
    try:
        return check_adapter_name(name)
    except InvalidAdapterNameError as e:
        raise HTTPError(400, str(e), code="invalid_adapter_name") from e


def allowed_adapter_path(dirs: tuple[str, ...], path: str) -> str:
    """The real path of a runtime-loaded adapter: under one of `dirs` (--allowed-adapter-dir, or a tenant's
    adapter_dir), safetensors only. (The engine resolves each file it reads again: a file inside may be a symlink
    to one outside.)"""
    if not dirs:
        raise HTTPError(400, "runtime adapter loading is off; start the server with --allowed-adapter-dir DIR")
    if "\x00" in path:
        raise HTTPError(400, "lora_path must not contain a NUL byte")
    real = os.path.realpath(path)  # symlinks and `..` resolved before the check
    allowed = [os.path.realpath(d) for d in dirs]
    if not any(os.path.commonpath([real, d]) == d for d in allowed):
        raise HTTPError(400, f"adapter path {path!r} is outside the allowed adapter directories ({', '.join(allowed)})")
    st, pickle = (os.path.join(real, f"adapter_model.{ext}") for ext in ("safetensors", "bin"))
    if not os.path.lexists(st) and os.path.lexists(pickle):
        raise HTTPError(400, f"adapter path {path!r} has adapter_model.bin but no adapter_model.safetensors (only "
                             "safetensors adapters are loaded at run time)")
    return real  # everything else about its files is checked by the engine, file by file


def load_kind(request: p.LoadLoRAAdapterRequest, path: str, base_name: str, loaded_path: str | None) -> str:
    """ADD, REPLACE (load_inplace of a loaded name) or AGAIN (a loaded name from the same path: it succeeds,
    and `pinned` pins it); 400 for the base model's name, or a loaded name from another path."""
    name = request.lora_name
    if name == base_name:
        raise HTTPError(400, f"'{name}' is the base model's name; choose another adapter name", code="adapter_exists")
    if loaded_path is None:
        return ADD
    if request.load_inplace:
        return REPLACE
    if os.path.realpath(loaded_path) == path:
        return AGAIN
    raise HTTPError(400, f"The lora adapter '{name}' has already been loaded (from {loaded_path}); unload it first, "
                         "or set load_inplace to replace its weights", code="adapter_exists")


def unload_name(request: p.UnloadLoRAAdapterRequest) -> str:
    """Adapters are addressed by name; vLLM's lora_int_id is refused rather than ignored."""
    if request.lora_int_id is not None:
        raise HTTPError(400, "lora_int_id is not supported: loramux addresses adapters by name; send lora_name alone",
                        code="lora_int_id")
    return request.lora_name


def not_found(name: str) -> HTTPError:
    return HTTPError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error")


def loaded(name: str, kind: str) -> PlainTextResponse:
    verb = f"{kind} successfully" if kind != AGAIN else "is already loaded from that path"
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {verb}.")


def removed(name: str) -> PlainTextResponse:
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def pinned(name: str, pin: bool) -> PlainTextResponse:
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {'pinned' if pin else 'unpinned'}.")
