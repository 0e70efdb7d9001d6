"""Adapters uploaded in the body of /v1/load_lora_adapter (multipart form data: adapter_config.json and
adapter_model.safetensors parts). Their files are written under one directory the server owns and loaded from
there as a runtime load is: every check of adapter files applies to them, an adapter evicted from host memory is
read back from them, and an engine restart loads them again (the registry keeps their path).

Each upload is a directory of its own. A name keeps the directories of its current upload, of the earlier
revisions the engine keeps, and of one more (requests still running on the revision that just left may read it
back); older ones go at the next upload of the name, all of them when it is unloaded.

The body is parsed as it arrives, on a worker thread (parsing tens of MB in the event loop would hold every
stream's tokens meanwhile), and the weights part is written straight into its file: one copy of the bytes
from the socket to the file (a spooled body, a parser's part file and a copy into place were three).
"""
from __future__ import annotations

import asyncio
import os
import queue
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from loramux.adapters.file_names import CONFIG_FILE, MAX_CONFIG_BYTES, SAFETENSORS_FILE

MAX_PARTS = 8  # an upload has five (lora_name, load_inplace, pinned and the two files)
CHUNKS_AHEAD = 64  # body chunks the event loop may queue ahead of the parser (a few MB)


class UploadFormError(ValueError):
    """The body is not the form an upload sends (the message says why; an HTTP 400)."""


class Uploads:
    def __init__(self, root: str, kept_per_name: int = 2):
        os.makedirs(root, mode=0o700, exist_ok=True)
        self.root = os.path.realpath(root)
        self.kept_per_name = kept_per_name
        self._dirs: dict[str, list[str]] = {}  # name -> its upload directories, oldest first

    def new_directory(self) -> str:
        return tempfile.mkdtemp(prefix="upload-", dir=self.root)

    def keep(self, name: str, path: str) -> None:
        """`path` is `name`'s current upload; all but its newest kept_per_name go."""
        dirs = self._dirs.setdefault(name, [])
        dirs.append(path)
        while len(dirs) > self.kept_per_name:
            discard(dirs.pop(0))

    def forget(self, name: str) -> None:
        for path in self._dirs.pop(name, []):
            discard(path)


def discard(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Part:
    name: str
    is_file: bool
    data: bytearray = field(default_factory=bytearray)  # a field's value, or adapter_config.json's bytes
    file: object = None  # adapter_model.safetensors: its file in the upload's directory


class _FormWriter:
    """python-multipart's callbacks: fields and adapter_config.json kept in memory (bounded), the weights part
    written into `directory` as it is parsed. `parts` maps each part's name to its _Part, in order."""

    def __init__(self, directory: str):
        self.directory = directory
        self.parts: dict[str, _Part] = {}
        self._header, self._value, self._disposition = b"", b"", b""
        self._part: _Part | None = None

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self) -> None:
        self._disposition = b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise UploadFormError('each part needs a Content-Disposition header with its "name"')
        name = options[b"name"].decode("utf-8", "replace")
        if name in self.parts:
            raise UploadFormError(f"the part {name!r} comes twice")
        if len(self.parts) == MAX_PARTS:
            raise UploadFormError(f"more than {MAX_PARTS} parts")
        part = self._part = self.parts[name] = _Part(name, b"filename" in options)
        if name == SAFETENSORS_FILE and part.is_file:
            part.file = open(os.path.join(self.directory, SAFETENSORS_FILE), "wb")

    def _data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        if part.file is not None:
            part.file.write(memoryview(data)[start:end])
        elif len(part.data) <= MAX_CONFIG_BYTES:  # past it: refused once parsed (the size is in the message)
            part.data += memoryview(data)[start:end]

    def _end(self) -> None:
        if self._part.file is not None:
            self._part.file.close()

    def close(self) -> None:
        for part in self.parts.values():
            if part.file is not None:
                part.file.close()


def _parse(boundary: bytes, chunks: queue.Queue, directory: str) -> dict[str, _Part]:
    """The worker thread's side: parse the chunks until None. After an error it drains the queue (the event
    loop may be blocked putting a chunk) and then raises it."""
    writer = _FormWriter(directory)
    parser = MultipartParser(boundary, writer.callbacks())
    error = None
    while (chunk := chunks.get()) is not None:
        if error is None:
            try:
                parser.write(chunk)
            except Exception as e:
                error = e
    try:
        if error is None:
            parser.finalize()
    except Exception as e:
        error = e
    finally:
        writer.close()
    if isinstance(error, MultipartParseError):
        raise UploadFormError(f"malformed multipart body: {error}")
    if error is not None:
        raise error
    return writer.parts


async def receive_form(content_type: str, body: AsyncIterator[bytes], directory: str) -> dict[str, _Part]:
    """The multipart body's parts, the weights part written into `directory` (its file, if the body has it).
    UploadFormError for a body that is not multipart form data; what reading the body raises (its size limit,
    a client gone) is raised after the parser has stopped."""
    _, options = parse_options_header(content_type)
    if b"boundary" not in options:
        raise UploadFormError("the multipart body's Content-Type has no boundary")
    chunks: queue.Queue = queue.Queue(maxsize=CHUNKS_AHEAD)
    parsed = asyncio.ensure_future(asyncio.to_thread(_parse, options[b"boundary"], chunks, directory))
    try:
        async for chunk in body:
            if parsed.done():  # refused already: the rest of the body is not read
                break
            await _put(chunks, chunk)
    except BaseException:
        await _put(chunks, None)
        await asyncio.wait([parsed])
        if not parsed.cancelled():
            parsed.exception()  # (retrieved: the body's own error is the one raised)
        raise
    await _put(chunks, None)
    return await parsed


async def _put(chunks: queue.Queue, item) -> None:
    try:
        chunks.put_nowait(item)
    except queue.Full:  # the parser is behind: wait for it off the event loop
        await asyncio.to_thread(chunks.put, item)
