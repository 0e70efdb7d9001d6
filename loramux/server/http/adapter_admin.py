"""The adapter admin routes' rules and answers — vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
and /v1/pin_lora_adapter, /v1/unpin_lora_adapter — shared by the single server (app.py) and the Ray Serve
ingress (ray_ingress.py): what a name and a path must be, when a load is a conflict, and the answers' texts.
Status codes follow vLLM's: 400 for a name already loaded from another path (vLLM answers 400 for any
loaded name; loading the same path again succeeds, as MAX's load_adapter does), 404 for an unknown name.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse

from loramux.adapters.file_names import CONFIG_FILE, MAX_CONFIG_BYTES, SAFETENSORS_FILE
from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name
from loramux.server.http import protocol as p
from loramux.server.http.errors import HTTPError
from loramux.server.http.uploads import UploadFormError, Uploads, discard, receive_form

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


async def load_request(raw: Request) -> p.LoadLoRAAdapterRequest:
    """/v1/load_lora_adapter's JSON body (checked as FastAPI checks a body: the same 400)."""
    try:
        body = json.loads(await raw.body())  # (as FastAPI decodes a body: lone surrogates reach the model's checks)
    except ValueError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", getattr(e, "pos", 0)),
                                       "msg": "JSON decode error", "input": {}}]) from None
    try:
        return p.LoadLoRAAdapterRequest.model_validate(body)
    except pydantic.ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


@dataclass
class Upload:
    """An adapter's files from the body of /v1/load_lora_adapter, written into `path` (a directory of its own
    under the server's uploads directory)."""

    name: str
    path: str
    pinned: bool
    load_inplace: bool


_FLAGS = {"true": True, "1": True, "false": False, "0": False, "": False}
_FIELDS = ("lora_name", "load_inplace", "pinned")


async def upload_form(raw: Request, limit: int, uploads: Uploads | None, may_change: Callable[[str], None]) -> Upload:
    """The multipart form of an upload: lora_name, optionally load_inplace and pinned (true / false), and the
    two files as parts named adapter_config.json and adapter_model.safetensors, written into a new directory of
    `uploads` as the body arrives. 400 naming what is wrong; may_change(name) raises the HTTPError of a caller
    who may not change that adapter, as soon as lora_name has arrived (the directory goes with either, and the
    rest of the body is not read)."""
    if not limit or uploads is None:
        raise HTTPError(400, "adapter uploads are off; start the server with --max-adapter-upload-bytes N")
    path = uploads.new_directory()

    def check_field(name: str, value: str) -> None:
        if name == "lora_name":
            may_change(checked_name(value))

    try:
        parts = await receive_form(raw.headers.get("content-type", ""), raw.stream(), path, check_field)
        upload = _upload(parts, path)
        may_change(upload.name)
        return upload
    except UploadFormError as e:
        discard(path)
        raise HTTPError(400, str(e)) from e
    except BaseException:
        discard(path)
        raise


def _upload(parts: dict, path: str) -> Upload:
    unknown = sorted(set(parts) - {*_FIELDS, CONFIG_FILE, SAFETENSORS_FILE})
    if unknown:
        raise UploadFormError(f"unknown form fields: {', '.join(unknown)} (an upload sends lora_name, load_inplace, "
                              f"pinned, {CONFIG_FILE} and {SAFETENSORS_FILE})")
    missing = [key for key in (CONFIG_FILE, SAFETENSORS_FILE) if key not in parts or not parts[key].is_file]
    if missing:
        raise UploadFormError(f"the upload needs the file parts {CONFIG_FILE} and {SAFETENSORS_FILE}; "
                              f"missing or not a file: {', '.join(missing)}")
    fields = {key: parts[key].data.decode("utf-8", "replace") for key in _FIELDS if key in parts}
    flags = {key: fields.get(key, "").lower() for key in ("load_inplace", "pinned")}
    bad = [key for key, value in flags.items() if value not in _FLAGS]
    if bad:
        raise UploadFormError(f"{', '.join(bad)} must be true or false")
    config = parts[CONFIG_FILE].data
    if len(config) > MAX_CONFIG_BYTES:
        raise UploadFormError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    with open(os.path.join(path, CONFIG_FILE), "wb") as f:
        f.write(config)
    name = checked_name(fields.get("lora_name", ""))
    return Upload(name, path, _FLAGS[flags["pinned"]], _FLAGS[flags["load_inplace"]])


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


def loaded(name: str, kind: str, headers: dict | None = None) -> PlainTextResponse:
    """vLLM's text; headers: the load's revision (x-adapter-revision), which requests may address."""
    verb = f"{kind} successfully" if kind != AGAIN else "is already loaded from that path"
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {verb}.", headers=headers)


def removed(name: str) -> PlainTextResponse:
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def pinned(name: str, pin: bool) -> PlainTextResponse:
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {'pinned' if pin else 'unpinned'}.")
