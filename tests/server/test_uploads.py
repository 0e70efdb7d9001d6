"""An upload's multipart body parsed as it arrives (server/http/uploads.py receive_form): the weights part
lands in its file byte for byte and the fields in memory, however the body is cut into chunks and however far the
parser falls behind; a malformed body is an UploadFormError, and an error reading the body stops the parser and is
the one raised."""
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
    ("multipart/form-data", b"--x\r\n", "no boundary"),
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
