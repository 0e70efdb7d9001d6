"""Adapters in object stores and on the web: `s3://`, `gs://`, `http(s)://` and `hf://` URIs, read through fsspec
(with s3fs, gcsfs or huggingface_hub for their schemes) into a local cache whose directory is then loaded as any
adapter directory is. No torch.

- Only the adapter's two files are fetched: adapter_config.json and adapter_model.safetensors (a remote adapter is
  safetensors only; pickle is never fetched).
- Each version of an adapter is a directory of its own, named by the URI and what the store says of each file (its
  size and its ETag, the Hub's SHA-256, or its Last-Modified time): a changed object is fetched again into a new
  directory; an unchanged one is not fetched at all. A directory is never written again, so an adapter evicted
  from host memory is read back from the very bytes it was loaded from.
- Integrity: the bytes must be as many as the store said; an ETag that is a plain MD5 (a single-part upload)
  and the Hub's SHA-256 must match them.
- Bounds: the files together at most `max_bytes` (checked before any byte is fetched, and while fetching), the
  whole fetch within `timeout_s`.
- Written into a temporary directory, then renamed: a fetch cut off leaves nothing a later load could take.
- Credentials and endpoints come from each library's usual environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL,
  GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN, ...).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass

from loramux.adapters.file_names import CONFIG_FILE, SAFETENSORS_FILE

SCHEMES = ("s3", "gs", "gcs", "http", "https", "hf")
FILES = (CONFIG_FILE, SAFETENSORS_FILE)
CHUNK = 1 << 20
_URI = re.compile(r"([a-z][a-z0-9+.-]*)://(.+)")
_MD5 = re.compile(r'"?([0-9a-f]{32})"?')


class RemoteAdapterError(ValueError):
    """A remote adapter that cannot be used: not allowed, too large, or not what the store said it is."""


class RemoteNotFoundError(RemoteAdapterError):
    """The store has no adapter there (no adapter_config.json)."""


class RemoteStoreError(RuntimeError):
    """The store failed or took too long (a clear error; the same fetch may work later)."""


def is_uri(path: str) -> bool:
    """Whether a path is a URI (scheme://...) rather than a local path."""
    return _URI.fullmatch(path) is not None


def check_uri(uri: str, allowed_prefixes: tuple[str, ...]) -> str:
    """`uri`, if it is a URI of a supported scheme under one of `allowed_prefixes` (a prefix covers itself and
    what lies under it after a "/"), with no "." or ".." segment, query or fragment; else RemoteAdapterError."""
    match = _URI.fullmatch(uri)
    if match is None or match[1] not in SCHEMES:
        raise RemoteAdapterError(f"{uri!r} is not a URI of a supported scheme ({', '.join(SCHEMES)})")
    segments = match[2].rstrip("/").split("/")
    if {".", ".."} & set(segments) or "?" in uri or "#" in uri:
        raise RemoteAdapterError(f"{uri!r}: a remote adapter's URI may hold no '.' or '..' segment, query or fragment")
    uri = uri.rstrip("/")
    if not any(uri == p.rstrip("/") or uri.startswith(p.rstrip("/") + "/") for p in allowed_prefixes):
        where = ", ".join(allowed_prefixes) or "none: --allowed-adapter-uri is not set"
        raise RemoteAdapterError(f"{uri!r} is not under an allowed adapter URI prefix ({where})")
    return uri


@dataclass(frozen=True)
class _File:
    path: str  # in the store's filesystem
    size: int
    version: str  # what changes when the object does ("" if the store says nothing)
    md5: str | None
    sha256: str | None


class RemoteCache:
    """Fetches remote adapters into `root`, one directory per version (see the module's docstring)."""

    def __init__(self, root: str | None, max_bytes: int, timeout_s: float):
        """root: None = a temporary directory, made on first use."""
        self._root = root
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._versions: dict[str, list[str]] = {}  # uri -> its directories fetched by this process, oldest first

    @property
    def root(self) -> str:
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="loramux-remote-")
        os.makedirs(self._root, mode=0o700, exist_ok=True)
        return os.path.realpath(self._root)

    def fetch(self, uri: str) -> str:
        """The local directory holding `uri`'s adapter as the store has it now (blocking: run it in a thread).
        RemoteNotFoundError, RemoteAdapterError (too large, not as the store said) or RemoteStoreError."""
        deadline = time.monotonic() + self.timeout_s
        fs, files = self._hub(uri) if uri.startswith("hf://") else self._store(uri)
        total = sum(f.size for f in files)
        if total > self.max_bytes:
            raise RemoteAdapterError(f"adapter {uri!r} is {total} bytes, over the {self.max_bytes} a remote adapter "
                                     "may take (--max-adapter-download-bytes)")
        key = json.dumps([uri, [(f.size, f.version) for f in files]])
        target = os.path.join(self.root, hashlib.sha256(key.encode()).hexdigest()[:32])
        if not os.path.isdir(target):
            self._download(fs, files, target, uri, deadline)
        versions = self._versions.setdefault(uri, [])  # (only directories that exist: prune counts them)
        if target not in versions:
            versions.append(target)
        return target

    def _download(self, fs, files: list[_File], target: str, uri: str, deadline: float) -> None:
        """The files into a temporary directory, renamed to `target` once whole."""
        partial = tempfile.mkdtemp(prefix=".partial-", dir=self.root)
        try:
            for name, file in zip(FILES, files):
                self._copy(fs, file, os.path.join(partial, name), uri, deadline)
            os.rename(partial, target)
        except OSError:
            if not os.path.isdir(target):  # (else another fetch of the same version finished first)
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def prune(self, uri: str, keep: int, in_use: set[str]) -> None:
        """Remove `uri`'s older directories: all but its newest `keep`, and never one in `in_use` (a loaded
        adapter's, which may be read back from it)."""
        versions = self._versions.get(uri, [])
        for path in versions[:-keep]:
            if path not in in_use:
                shutil.rmtree(path, ignore_errors=True)
                versions.remove(path)

    def _store(self, uri: str) -> tuple:
        """An object store's or web server's filesystem, and what it says of the two files."""
        import fsspec

        protocol = uri.split("://", 1)[0]
        try:  # a new instance each time: no listing or info cached from an earlier fetch hides a change
            fs, base = fsspec.core.url_to_fs(uri, skip_instance_cache=True, use_listings_cache=False,
                                             **_timeouts(protocol, self.timeout_s))
        except ImportError as e:
            raise RemoteAdapterError(f"{protocol}:// adapters need an fsspec backend: {e}") from e
        return fs, [self._stat(fs, f"{base}/{name}", uri) for name in FILES]

    @staticmethod
    def _hub(uri: str) -> tuple:
        """hf://org/repo[@revision][/subdir]: downloaded through huggingface_hub into its cache (only the two
        files; from the cache alone with HF_HUB_OFFLINE=1), then copied from there. A file the Hub stores in
        LFS is named in that cache by its SHA-256, which the copy checks."""
        import fsspec
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        parts = uri[len("hf://"):].split("/")
        if len(parts) < 2:
            raise RemoteAdapterError(f"{uri!r}: a Hub URI is hf://org/repo[@revision][/subdirectory]")
        repo, _, revision = "/".join(parts[:2]).partition("@")
        sub = "/".join(parts[2:])
        patterns = [f"{sub}/{name}" if sub else name for name in FILES]
        try:
            snapshot = snapshot_download(repo, revision=revision or None, allow_patterns=patterns,
                                         local_files_only=constants.HF_HUB_OFFLINE)
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError, LocalEntryNotFoundError) as e:
            raise RemoteNotFoundError(f"adapter {uri!r}: {type(e).__name__}: {e}") from e
        except Exception as e:
            raise RemoteStoreError(f"adapter {uri!r}: the Hub failed: {type(e).__name__}: {e}") from e
        files = []
        for pattern in patterns:
            path = os.path.join(snapshot, pattern)
            if not os.path.isfile(path):
                raise RemoteNotFoundError(f"adapter {uri!r}: the Hub has no {pattern}")
            blob = os.path.basename(os.path.realpath(path))
            sha256 = blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None
            commit = os.path.basename(snapshot)
            files.append(_File(path, os.path.getsize(path), f"{commit}/{blob}", None, sha256))
        return fsspec.filesystem("file"), files

    @staticmethod
    def _stat(fs, path: str, uri: str) -> _File:
        try:
            info = fs.info(path)
        except FileNotFoundError as e:
            cause = e.__cause__  # (fsspec's http backend says "not found" for any failure: its cause says which)
            if cause is not None and getattr(cause, "status", None) != 404:
                said = f"it answered {cause.status} {getattr(cause, 'message', '')}" if hasattr(cause, "status") \
                    else f"{type(cause).__name__}: {cause}"
                raise RemoteStoreError(f"adapter {uri!r}: the store failed: {said}") from e
            raise RemoteNotFoundError(f"adapter {uri!r}: the store has no {path.rsplit('/', 1)[-1]}") from None
        except Exception as e:
            raise RemoteStoreError(f"adapter {uri!r}: the store failed: {type(e).__name__}: {e}") from e
        size = info.get("size")
        if not isinstance(size, int) or info.get("type", "file") != "file":
            raise RemoteAdapterError(f"adapter {uri!r}: {path.rsplit('/', 1)[-1]} is not a file of known size")
        etag = str(info.get("ETag") or info.get("etag") or "")
        lfs = info.get("lfs") or {}
        sha256 = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
        version = etag or sha256 or str(info.get("blob_id") or info.get("Last-Modified") or info.get("LastModified") or "")
        md5 = _MD5.fullmatch(etag)
        return _File(path, size, version, md5[1] if md5 else None, sha256)

    def _copy(self, fs, file: _File, dest: str, uri: str, deadline: float) -> None:
        digests = {"md5": hashlib.md5(), "sha256": hashlib.sha256()}
        got = 0
        try:
            with fs.open(file.path, "rb") as src, open(dest, "wb") as out:
                while chunk := src.read(CHUNK):
                    got += len(chunk)
                    if got > file.size:
                        raise RemoteAdapterError(f"adapter {uri!r}: {file.path} holds more than the {file.size} "
                                                 "bytes the store said (it changed while fetched?)")
                    if time.monotonic() > deadline:
                        raise RemoteStoreError(f"adapter {uri!r}: fetching took over {self.timeout_s:g} s "
                                               "(--adapter-download-timeout)")
                    for digest in digests.values():
                        digest.update(chunk)
                    out.write(chunk)
        except (RemoteAdapterError, RemoteStoreError):
            raise
        except Exception as e:
            raise RemoteStoreError(f"adapter {uri!r}: the store failed: {type(e).__name__}: {e}") from e
        for name, expected in (("size", str(file.size)), ("md5", file.md5), ("sha256", file.sha256)):
            actual = str(got) if name == "size" else digests[name].hexdigest()
            if expected is not None and actual != expected:
                raise RemoteAdapterError(f"adapter {uri!r}: {file.path}'s {name} is {actual}, the store said "
                                         f"{expected}")


def _timeouts(protocol: str, seconds: float) -> dict:
    """Socket timeouts for the backends that take them, so a stalled store ends a fetch's thread too."""
    if protocol == "s3":
        return {"config_kwargs": {"connect_timeout": seconds, "read_timeout": seconds}}
    if protocol in ("http", "https"):
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=seconds)}}
    return {}


class URIResolver:
    """`--lora-resolver-uri PREFIX`: the adapter a name nobody registered is PREFIX/<name>/ in a store, fetched
    into the cache (adapters.resolvers). A store with no adapter there does not know the name; a store that fails
    is an error for the request (not a 404)."""

    def __init__(self, prefix: str, cache: RemoteCache):
        self.prefix = check_uri(prefix, (prefix,))
        self.cache = cache

    def uri_of(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def resolve(self, base_model: str, name: str) -> str | None:
        try:
            return self.cache.fetch(self.uri_of(name))
        except RemoteNotFoundError:
            return None

    def allowed_dirs(self, path: str) -> tuple[str, ...]:
        return (self.cache.root,)

    def __str__(self) -> str:
        return f"store {self.prefix}"
