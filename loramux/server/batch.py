"""`loramux run-batch`: an OpenAI batch input file (JSONL) answered by a `loramux serve` of the same flags, started
for the run and stopped after it (vLLM's run_batch). No torch.

- Each input line: {"custom_id": str, "method": "POST", "url": one of URLS, "body": {...}}; `body.model` names the
  line's adapter (or the base model), so one file mixes adapters. The whole file is checked before anything runs:
  a bad line stops the run naming it.
- Each output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}, the
  body as the server answered it (an error body for a 4xx / 5xx), written as each answer comes (flushed), so the
  output's order is the answers' order.
- Resumable: lines whose custom_id the output file already answers are not sent again; a torn last line (the run
  killed while writing it) is dropped first.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import httpx

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")


class BatchFileError(ValueError):
    """The input file cannot run as it is; the message names the line."""


def read_input(path: str) -> list[dict]:
    """The input file's requests, each checked (BatchFileError naming the first bad line)."""
    lines, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            lines.append(_checked(text, number, seen))
    return lines


def _checked(text: str, number: int, seen: set) -> dict:
    where = f"line {number}"
    try:
        line = json.loads(text)
    except ValueError as e:
        raise BatchFileError(f"{where}: not JSON ({e})") from None
    if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str) or not line["custom_id"]:
        raise BatchFileError(f"{where}: each line needs a custom_id (a non-empty string)")
    if line["custom_id"] in seen:
        raise BatchFileError(f"{where}: custom_id {line['custom_id']!r} is used twice")
    if line.get("method", "POST") != "POST" or line.get("url") not in URLS:
        raise BatchFileError(f"{where}: method must be POST and url one of {', '.join(URLS)}")
    if not isinstance(line.get("body"), dict) or line["body"].get("stream"):
        raise BatchFileError(f"{where}: body must be an object, without stream: true")
    seen.add(line["custom_id"])
    return line


def answered(path: str) -> set[str]:
    """The custom_ids the output file already answers; a torn last line is cut off the file."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    keep = data if data.endswith(b"\n") or not data else data[:data.rfind(b"\n") + 1]
    if keep != data:
        with open(path, "wb") as f:
            f.write(keep)
    return {json.loads(line)["custom_id"] for line in keep.decode("utf-8").splitlines() if line.strip()}


def run(input_path: str, output_path: str, serve_args: list[str], concurrency: int = 64) -> int:
    """Answer every line not yet answered; the number answered now."""
    lines = read_input(input_path)
    done = answered(output_path)
    todo = [line for line in lines if line["custom_id"] not in done]
    print(f"{len(lines)} requests, {len(lines) - len(todo)} answered already, {len(todo)} to run", file=sys.stderr)
    if not todo:
        return 0
    proc, url = _start_server(serve_args)
    try:
        return asyncio.run(_send_all(url, todo, output_path, concurrency))
    finally:
        proc.terminate()
        proc.wait(60)


def _start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    """The server, on a socket opened here and handed over (--listen-fd): a port picked here and bound by the
    server seconds later could be taken by another process meanwhile."""
    with socket.create_server(("127.0.0.1", 0), backlog=2048) as sock:
        cmd = [sys.executable, "-m", "loramux", "serve", *serve_args, "--listen-fd", str(sock.fileno())]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, pass_fds=(sock.fileno(),))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while proc.poll() is None:  # start-up is the server's to bound (--engine-start-timeout)
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"loramux serve exited with code {proc.returncode} before it was ready (its log is above)")


async def _send_all(url: str, todo: list[dict], output_path: str, concurrency: int) -> int:
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    with open(output_path, "a", encoding="utf-8") as out, tqdm(total=len(todo), unit="req") as bar:
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
            async def one(line: dict) -> None:
                async with gate:
                    response = await client.post(line["url"], json=line["body"])
                out.write(json.dumps(_result(line, response), ensure_ascii=False) + "\n")
                out.flush()
                bar.update()

            await asyncio.gather(*(one(line) for line in todo))
    return len(todo)


def _result(line: dict, response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text, "type": "server_error"}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"],
            "response": {"status_code": response.status_code, "request_id": body.get("id") if isinstance(body, dict)
                         else None, "body": body}, "error": None}
