"""Adapter resolvers: where the adapter a request names lives, for names nobody registered (vLLM's LoRAResolver
plugins; LoRAX's "any adapter, loaded on the first request"). No torch.

A resolver is any object with `resolve(base_model: str, name: str) -> str | None`: a local directory that holds
the adapter (fetched there first if it has to be: it is called off the step loop, in a thread, and may be
slow), or None when it does not know the name. The server asks its resolvers in order, built-ins first:
`--lora-resolver-dir DIR` (DirectoryResolver), `--lora-resolver-uri PREFIX` (remote.URIResolver: a store),
`--lora-resolver-hf` (HFCacheResolver), then plugins, given as
`--lora-resolver module:attribute` or found in the entry-point group `loramux.lora_resolvers`. A plugin's
attribute is a resolver, or a class or function that makes one when called with no arguments.

Each resolved directory is read under the same rules as a runtime load: safetensors only, every file resolved
inside the directory the resolver answers for (`allowed_dirs`), so a symlink or `..` inside cannot escape.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger("loramux.server")
ENTRY_POINT_GROUP = "loramux.lora_resolvers"


class LoRAResolver(Protocol):
    def resolve(self, base_model: str, name: str) -> str | None: ...


@dataclass(frozen=True)
class Resolved:
    """Where a name's adapter is, and the directories its files must resolve into."""

    path: str
    allowed_dirs: tuple[str, ...]
    uri: str = ""  # where a store's adapter came from (remote.URIResolver), shown as its root


def _adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


class DirectoryResolver:
    """DIR/<name>/ is the adapter (a name with "/", org/adapter, is a subdirectory), if it stays inside DIR."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        if not os.path.isdir(self.root):
            raise ValueError(f"--lora-resolver-dir {root}: not a directory")

    def resolve(self, base_model: str, name: str) -> str | None:
        path = os.path.realpath(os.path.join(self.root, name))
        if os.path.commonpath([path, self.root]) != self.root or not _adapter_dir(path):
            return None
        return path

    def allowed_dirs(self, path: str) -> tuple[str, ...]:
        return (self.root,)

    def __str__(self) -> str:
        return f"directory {self.root}"


class HFCacheResolver:
    """A Hub id (org/adapter) found in the local Hugging Face cache; with network access allowed (HF_HUB_OFFLINE
    unset), downloaded there through huggingface_hub first (the adapter's config and safetensors only)."""

    PATTERNS = ("adapter_config.json", "adapter_model.safetensors")

    def __init__(self, cache_dir: str | None = None):
        from huggingface_hub import constants

        self.cache_dir = os.path.realpath(cache_dir or constants.HF_HUB_CACHE)
        self.offline = constants.HF_HUB_OFFLINE

    def resolve(self, base_model: str, name: str) -> str | None:
        if name.count("/") != 1:
            return None
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(name, cache_dir=self.cache_dir, allow_patterns=list(self.PATTERNS),
                                     local_files_only=self.offline)
        except Exception as e:  # not cached (offline), not on the Hub, no access: this resolver does not know it
            logger.debug("the Hugging Face resolver has no %r: %s", name, e)
            return None
        return path if _adapter_dir(path) else None

    def allowed_dirs(self, path: str) -> tuple[str, ...]:
        return (self.cache_dir,)  # a snapshot's files are links into the cache's blobs

    def __str__(self) -> str:
        return f"huggingface cache {self.cache_dir}" + (" (offline)" if self.offline else "")


def from_spec(spec: str) -> LoRAResolver:
    """`module:attribute` -> the resolver it names (a class or function is called with no arguments)."""
    module, _, attribute = spec.partition(":")
    if not module or not attribute:
        raise ValueError(f"--lora-resolver {spec}: expected module:attribute")
    try:
        target = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--lora-resolver {spec}: {e}") from e
    return _made(target, spec)


def _made(target, where: str) -> LoRAResolver:
    made = isinstance(target, type) or (callable(target) and not hasattr(target, "resolve"))
    resolver = target() if made else target  # a class or a factory function, else the resolver itself
    if not callable(getattr(resolver, "resolve", None)):
        raise ValueError(f"resolver {where}: {resolver!r} has no resolve(base_model, name)")
    return resolver


def from_entry_points() -> list[LoRAResolver]:
    """The resolvers installed packages declare in the entry-point group loramux.lora_resolvers."""
    from importlib.metadata import entry_points

    return [_made(point.load(), f"entry point {point.name}") for point in entry_points(group=ENTRY_POINT_GROUP)]


def build(dirs: list[str] = (), hf_cache: bool = False, specs: list[str] = (), plugins: bool = True,
          uris: list[str] = (), cache=None) -> list:
    """The server's resolvers, in the order they are asked. uris: store prefixes (remote.URIResolver), fetched
    into `cache` (a remote.RemoteCache)."""
    from loramux.adapters.remote import URIResolver

    resolvers: list = [DirectoryResolver(d) for d in dirs]
    resolvers += [URIResolver(uri, cache) for uri in uris]
    if hf_cache:
        resolvers.append(HFCacheResolver())
    resolvers += [from_spec(s) for s in specs]
    return resolvers + (from_entry_points() if plugins else [])


def resolve(resolvers: list, base_model: str, name: str) -> Resolved | None:
    """The first answer of `resolvers` for `name` (blocking: run it in a thread)."""
    for resolver in resolvers:
        path = resolver.resolve(base_model, name)
        if path is None:
            continue
        path = os.path.realpath(path)
        if not _adapter_dir(path):
            raise ValueError(f"resolver {resolver} answered {path} for {name!r}, which holds no adapter_config.json")
        allowed = resolver.allowed_dirs(path) if hasattr(resolver, "allowed_dirs") else (path,)
        return Resolved(path, tuple(allowed), resolver.uri_of(name) if hasattr(resolver, "uri_of") else "")
    return None


def describe(resolvers: list) -> str:
    return ", ".join(str(r) for r in resolvers) or "none"
