"""The adapter admin routes' rules and answers — vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
and /v1/pin_lora_adapter, /v1/unpin_lora_adapter — shared by the single server (app.py) and the Ray Serve
ingress (ray_ingress.py): what a name and a path must be, when a load is a conflict, and the answers' texts.
Status codes follow vLLM's: 400 for a name already loaded from another path (vLLM answers 400 for any
loaded name; loading the same path again succeeds, as MAX's load_adapter does), 404 for an unknown name.
"""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
from dataclasses import dataclass
from typing import BinaryIO

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.formparsers import MultiPartException, MultiPartParser

from loramux.adapters.file_names import CONFIG_FILE, MAX_CONFIG_BYTES, SAFETENSORS_FILE
from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name
from loramux.server.http import protocol as p
from loramux.server.http.errors import HTTPError

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
    """An adapter's files from the body of /v1/load_lora_adapter."""

    name: str
    config: bytes
    weights: BinaryIO
    pinned: bool
    load_inplace: bool


_FLAGS = {"true": True, "1": True, "false": False, "0": False, "": False}


async def upload_form(raw: Request, limit: int) -> Upload:
    """The multipart form of an upload: lora_name, optionally load_inplace and pinned (true / false), and the
    two files as parts named adapter_config.json and adapter_model.safetensors. 400 naming what is wrong."""
    if not limit:
        raise HTTPError(400, "adapter uploads are off; start the server with --max-adapter-upload-bytes N")
    form = await _form_off_the_loop(raw)
    unknown = sorted(set(form) - {"lora_name", "load_inplace", "pinned", CONFIG_FILE, SAFETENSORS_FILE})
    if unknown:
        raise HTTPError(400, f"unknown form fields: {', '.join(unknown)} (an upload sends lora_name, load_inplace, "
                             f"pinned, {CONFIG_FILE} and {SAFETENSORS_FILE})")
    files = {key: form.get(key) for key in (CONFIG_FILE, SAFETENSORS_FILE)}
    missing = [key for key, part in files.items() if isinstance(part, str) or part is None]
    if missing:
        raise HTTPError(400, f"the upload needs the file parts {CONFIG_FILE} and {SAFETENSORS_FILE}; "
                             f"missing or not a file: {', '.join(missing)}")
    flags = {key: str(form.get(key, "")).lower() for key in ("load_inplace", "pinned")}
    bad = [key for key, value in flags.items() if value not in _FLAGS]
    if bad:
        raise HTTPError(400, f"{', '.join(bad)} must be true or false")
    config = await files[CONFIG_FILE].read(MAX_CONFIG_BYTES + 1)
    if len(config) > MAX_CONFIG_BYTES:
        raise HTTPError(400, f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    name = checked_name(str(form.get("lora_name") or ""))
    return Upload(name, config, files[SAFETENSORS_FILE].file, _FLAGS[flags["pinned"]], _FLAGS[flags["load_inplace"]])


async def _form_off_the_loop(raw: Request):
    """The multipart form, parsed in a worker thread: parsing tens of MB in the event loop would hold every
    stream's tokens meanwhile. The body is spooled as it comes (to disk past a few MB), then parsed there."""
    body = tempfile.SpooledTemporaryFile(max_size=4 << 20)
    async for chunk in raw.stream():
        body.write(chunk)
    body.seek(0)

    async def chunks():
        while chunk := body.read(1 << 20):
            yield chunk

    def parse():
        parser = MultiPartParser(raw.headers, chunks(), max_files=2, max_fields=3, max_part_size=MAX_CONFIG_BYTES)
        return asyncio.run(parser.parse())

    try:
        return await asyncio.to_thread(parse)
    except MultiPartException as e:
        raise HTTPError(400, e.message) from e
    finally:
        body.close()


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
