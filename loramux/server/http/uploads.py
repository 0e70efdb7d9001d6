"""Adapters uploaded in the body of /v1/load_lora_adapter (multipart form data: adapter_config.json and
adapter_model.safetensors parts). Their files are written under one directory the server owns and loaded from
there as a runtime load is: every check of adapter files applies to them, an adapter evicted from host memory is
read back from them, and an engine restart loads them again (the registry keeps their path).

Each upload is a directory of its own. A name keeps the directories of its current upload, of the earlier
revisions the engine keeps, and of one more (requests still running on the revision that just left may read it
back); older ones go at the next upload of the name, all of them when it is unloaded.

The body is parsed as it arrives, on a thread of its own (parsing tens of MB in the event loop would hold every
stream's tokens meanwhile), and the weights part is written straight into its file: one copy of the bytes
from the socket to the file (a spooled body, a parser's part file and a copy into place were three).
"""
from __future__ import annotations

import asyncio
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError, MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from loramux.adapters.file_names import CONFIG_FILE, MAX_CONFIG_BYTES, SAFETENSORS_FILE

MAX_PARTS = 8  # an upload has five (lora_name, load_inplace, pinned and the two files)
MAX_HEADER_BYTES = 8192  # a part's header line
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

    def __init__(self, directory: str, check_field: Callable[[str, str], None] | None = None):
        self.directory, self.check_field = directory, check_field
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
        self._header = _capped(self._header + data[start:end])

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value = _capped(self._value + data[start:end])

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
        part = self._part
        if part.file is not None:
            part.file.close()
        elif self.check_field is not None and not part.is_file:
            self.check_field(part.name, part.data.decode("utf-8", "replace"))

    def close(self) -> None:
        for part in self.parts.values():
            if part.file is not None:
                part.file.close()


def _capped(header: bytes) -> bytes:
    if len(header) > MAX_HEADER_BYTES:
        raise UploadFormError(f"a part's header is over {MAX_HEADER_BYTES} bytes")
    return header


class _Reader:
    """One upload's parse: a thread of its own (never the event loop's shared pool, which a few slow uploads
    could fill) takes the chunks the event loop feeds it. Back-pressure needs no thread: the loop waits while
    CHUNKS_AHEAD chunks are queued, and the parser reports what it has taken every REPORT_EVERY chunks and
    whenever it has taken all there is.
    `failed` is set as soon as the body is refused, so the loop stops reading it."""

    REPORT_EVERY = 16

    def __init__(self, boundary: bytes, directory: str, check_field: Callable[[str, str], None] | None):
        self._loop = asyncio.get_running_loop()
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._queued, self._room = 0, asyncio.Event()  # (event-loop side) chunks not reported taken
        self.failed = threading.Event()
        self.finished: asyncio.Future = self._loop.create_future()
        threading.Thread(target=self._run, args=(_FormWriter(directory, check_field), boundary), name="loramux-upload",
                         daemon=True).start()

    async def feed(self, chunk: bytes) -> None:
        while self._queued >= CHUNKS_AHEAD and not self.failed.is_set():
            self._room.clear()
            await self._room.wait()
        self._queued += 1
        self._chunks.put(chunk)

    def end(self) -> None:
        self._chunks.put(None)

    def _taken(self, count: int) -> None:
        self._queued -= count
        self._room.set()

    def _run(self, writer: _FormWriter, boundary: bytes) -> None:
        try:
            outcome, error = self._parse(writer, boundary), None
        except BaseException as e:
            outcome, error = None, e
        try:
            self._loop.call_soon_threadsafe(_settle, self.finished, outcome, error)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _parse(self, writer: _FormWriter, boundary: bytes) -> dict[str, _Part]:
        """Every chunk is taken until None, after an error too (it is raised then)."""
        error, unreported = None, 0
        try:
            parser = MultipartParser(boundary, writer.callbacks())
        except Exception as e:
            parser, error = None, e
            self._refuse()
        while (chunk := self._chunks.get()) is not None:
            if error is None:
                try:
                    parser.write(chunk)
                except Exception as e:
                    error = e
                    self._refuse()
            unreported += 1
            if unreported == self.REPORT_EVERY or self._chunks.empty():  # (never blocks with chunks unreported)
                self._loop.call_soon_threadsafe(self._taken, unreported)
                unreported = 0
        try:
            if error is None:
                parser.finalize()
                if parser.state != MultipartState.END:
                    error = UploadFormError("the multipart body ends before its closing boundary")
        except Exception as e:
            error = e
        finally:
            writer.close()
        if isinstance(error, (MultipartParseError, FormParserError)):
            raise UploadFormError(f"malformed multipart body: {error}")
        if error is not None:
            raise error
        return writer.parts

    def _refuse(self) -> None:
        self.failed.set()
        self._loop.call_soon_threadsafe(self._room.set)  # a loop waiting for room stops reading


def _settle(future: asyncio.Future, outcome, error) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(outcome)


async def receive_form(content_type: str, body: AsyncIterator[bytes], directory: str,
                       check_field: Callable[[str, str], None] | None = None) -> dict[str, _Part]:
    """The multipart body's parts, the weights part written into `directory` (its file, if the body has it).
    check_field(name, value) is called on the parser's thread as each field ends: what it raises refuses the body
    there. UploadFormError for a body that is not multipart form data (the rest of the body is not read then); what
    reading the body raises (its size limit, a client gone) is raised once the parser has stopped. Whatever
    happens, the parser has stopped and closed its file when this returns or raises."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary", b"")
    if not 1 <= len(boundary) <= 70:  # RFC 2046
        raise UploadFormError("the multipart body's Content-Type needs a boundary of 1 to 70 characters")
    reader = _Reader(boundary, directory, check_field)
    try:
        async for chunk in body:
            if reader.failed.is_set():
                break
            await reader.feed(chunk)
    finally:
        reader.end()
        await _uninterrupted(reader.finished)
        reader.finished.exception()  # (retrieved: where the body raised, its own error is the one raised)
    return reader.finished.result()


async def _uninterrupted(future: asyncio.Future) -> None:
    """Wait until `future` is done, even through a cancellation (then raised after): the caller removes the
    directory the parser writes into."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # the future's own error: the caller takes it from the future
            pass
    if cancelled:
        raise asyncio.CancelledError
