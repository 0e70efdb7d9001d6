"""An upload's multipart body parsed as it arrives (server/http/uploads.py receive_form): the weights part
lands in its file byte for byte and the fields in memory, however the body is cut into chunks and however far the
parser falls behind; a malformed body is an UploadFormError and the rest of it is not read; an error reading the
body, or a cancellation, stops the parser and is the one raised; uploads in flight beyond the event loop's
default thread pool all finish (each parser has a thread of its own)."""
import asyncio
import io
import os
import random

import httpx
import pytest

from loramux.adapters.file_names import CONFIG_FILE, MAX_CONFIG_BYTES, SAFETENSORS_FILE
from loramux.server.http import uploads
from loramux.server.http.uploads import UploadFormError, receive_form


def body_of(fields: dict, files: dict) -> tuple[str, bytes]:
    """(Content-Type, body) as httpx (the requests library alike) sends a form with files."""
    request = httpx.Request("POST", "http://x/", data=fields, files={k: (k, io.BytesIO(v)) for k, v in files.items()})
    return request.headers["content-type"], request.read()


async def chunked(body: bytes, seed: int, error: Exception | None = None):
    rng = random.Random(seed)
    at = 0
    while at < len(body):
        step = rng.choice([1, 7, 100, 4096, 65536, 300_000])
        yield body[at:at + step]
        at += step
        if error is not None and at > len(body) // 2:
            raise error


def receive(content_type: str, stream, directory: str) -> dict:
    return asyncio.run(receive_form(content_type, stream, directory))


@pytest.mark.parametrize("seed", range(4))
def test_the_weights_land_in_their_file_and_the_fields_in_memory_however_the_body_is_cut(tmp_path, monkeypatch,
                                                                                          seed):
    monkeypatch.setattr(uploads, "CHUNKS_AHEAD", 1 if seed % 2 else 64)  # a parser always behind, or not
    weights = random.Random(seed).randbytes(1_500_000)
    content_type, body = body_of({"lora_name": "acme/policy", "load_inplace": "true"},
                                 {CONFIG_FILE: b'{"r": 16}', SAFETENSORS_FILE: weights})
    parts = receive(content_type, chunked(body, seed), str(tmp_path))
    assert list(parts) == ["lora_name", "load_inplace", CONFIG_FILE, SAFETENSORS_FILE]
    assert bytes(parts["lora_name"].data) == b"acme/policy" and not parts["lora_name"].is_file
    assert bytes(parts[CONFIG_FILE].data) == b'{"r": 16}' and parts[CONFIG_FILE].is_file
    assert (tmp_path / SAFETENSORS_FILE).read_bytes() == weights and parts[SAFETENSORS_FILE].file.closed
    assert os.listdir(tmp_path) == [SAFETENSORS_FILE]  # the config is the caller's to write, once checked


def test_a_field_past_the_config_limit_is_kept_only_to_the_limit(tmp_path):
    content_type, body = body_of({}, {CONFIG_FILE: b"x" * (MAX_CONFIG_BYTES + 100_000), SAFETENSORS_FILE: b"w"})
    parts = receive(content_type, chunked(body, 0), str(tmp_path))
    assert MAX_CONFIG_BYTES < len(parts[CONFIG_FILE].data) < MAX_CONFIG_BYTES + 300_000  # refused by its length


@pytest.mark.parametrize("content_type, body, words", [
    ("multipart/form-data", b"--x\r\n", "boundary of 1 to 70"),
    ("multipart/form-data; boundary=" + "x" * 71, b"--x\r\n", "boundary of 1 to 70"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\nvvv", "closing boundary"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=" + b"n" * 9000 + b"\r\n\r\nv\r\n"
                                        b"--x--\r\n", "[Hh]eader"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--\r\n", '"name"'),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n"
                                        b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n2\r\n--x--\r\n", "twice"),
    ("multipart/form-data; boundary=x", b"".join(b"--x\r\nContent-Disposition: form-data; name=f%d\r\n\r\nv\r\n" % i
                                                 for i in range(9)) + b"--x--\r\n", "more than 8 parts"),
    ("multipart/form-data; boundary=x", b"garbage", "malformed multipart body"),
])
def test_a_body_that_is_not_an_upload_form_is_refused_naming_why(tmp_path, content_type, body, words):
    with pytest.raises(UploadFormError, match=words):
        receive(content_type, chunked(body, 1), str(tmp_path))


def test_an_error_reading_the_body_stops_the_parser_and_is_the_one_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(uploads, "CHUNKS_AHEAD", 1)
    content_type, body = body_of({"lora_name": "a"}, {CONFIG_FILE: b"{}", SAFETENSORS_FILE: bytes(2_000_000)})
    with pytest.raises(ConnectionResetError, match="client gone"):
        receive(content_type, chunked(body, 2, ConnectionResetError("client gone")), str(tmp_path))


def test_a_refused_body_is_not_read_to_its_end(tmp_path):
    pulled = []

    async def body():
        yield b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n"
        yield b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n2\r\n"  # twice: refused here
        for i in range(100_000):
            pulled.append(i)
            yield b"z" * 1000
            await asyncio.sleep(0)

    with pytest.raises(UploadFormError, match="twice"):
        receive("multipart/form-data; boundary=x", body(), str(tmp_path))
    assert len(pulled) < 1000


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="open files are read from /proc")
def test_a_cancelled_upload_stops_its_parser_before_the_cancellation_is_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(uploads, "CHUNKS_AHEAD", 1)
    content_type, full = body_of({"lora_name": "a"}, {CONFIG_FILE: b"{}", SAFETENSORS_FILE: bytes(3_000_000)})
    started = asyncio.Event()

    async def body():
        yield full[:200_000]
        started.set()
        await asyncio.Event().wait()  # the client stalls

    async def main():
        task = asyncio.ensure_future(receive_form(content_type, body(), str(tmp_path)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return open_files_under(tmp_path)

    held = asyncio.run(main())
    assert (tmp_path / SAFETENSORS_FILE).exists()  # it was being written
    assert held == []  # and was closed before the cancellation came out: nothing writes there any more


def open_files_under(directory) -> list[str]:
    """The files under `directory` this process holds open."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            held.append(target)
    return held


def test_more_uploads_in_flight_than_the_default_thread_pool_all_finish(tmp_path):
    content_type, full = body_of({"lora_name": "a"}, {CONFIG_FILE: b"{}", SAFETENSORS_FILE: bytes(300_000)})
    uploads_in_flight = 40  # the default pool has min(32, cores + 4) threads

    async def slow(barrier: asyncio.Event):
        yield full[:1000]
        await barrier.wait()  # every upload is under way before any ends
        for at in range(1000, len(full), 4096):
            yield full[at:at + 4096]

    async def main():
        barrier = asyncio.Event()
        tasks = [asyncio.ensure_future(receive_form(content_type, slow(barrier), str(tmp_path / str(i))))
                 for i in range(uploads_in_flight)]
        await asyncio.sleep(0)
        barrier.set()
        return await asyncio.gather(*tasks)

    for i in range(uploads_in_flight):
        (tmp_path / str(i)).mkdir()
    assert all(SAFETENSORS_FILE in parts for parts in asyncio.run(main()))


def test_a_field_check_refuses_the_body_as_soon_as_the_field_has_arrived(tmp_path):
    """check_field (the tenant's may-change rule on lora_name): what it raises is raised, and the weights after
    the field are not read."""
    pulled = []

    def check(name, value):
        if name == "lora_name" and value.startswith("beta/"):
            raise PermissionError(f"{value!r} is not yours")

    async def body():
        yield b"--x\r\nContent-Disposition: form-data; name=lora_name\r\n\r\nbeta/policy\r\n"
        yield b'--x\r\nContent-Disposition: form-data; name=adapter_model.safetensors; filename=w\r\n\r\n'
        for i in range(100_000):
            pulled.append(i)
            yield b"w" * 1000
            await asyncio.sleep(0)

    with pytest.raises(PermissionError, match="not yours"):
        asyncio.run(receive_form("multipart/form-data; boundary=x", body(), str(tmp_path), check))
    assert len(pulled) < 1000
