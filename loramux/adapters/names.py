"""Adapter names: what a user may call an adapter, the "name=path" argument form, and AdapterRef, the
identity of one load of an adapter. Stdlib only (the HTTP front end checks names too).

A name is what clients send as `model` and what /metrics lists, so it is never read as a path and never
holds a character that other formats give a meaning to: "=" (the name=path form), "," (the adapter
lists of `lora_requests_info`), whitespace or control characters (headers, logs, label values). "/" is
allowed inside (Hub-style "org/adapter" ids, as vLLM users name them), but a name may not look like a
path (start with "/", ".", "~" or hold a ".." segment), and it is canonical: no "." or empty segment and
no "/" at its end, so that no two names are spellings of one path (`a0/.`, `a0/`, `a0//`, `acme/./legal`
would all be the directory of `a0` or `acme/legal` under a resolver's directory).
"""
from __future__ import annotations

import itertools
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+/-]*")
RULE = (f"1-{MAX_NAME_LENGTH} characters from letters, digits and _ . : @ + / -, starting with a letter, digit "
        "or _, with no '.', '..' or empty segment between '/'s and no '/' at the end")


class InvalidAdapterNameError(ValueError):
    """The name breaks the naming rule (RULE)."""


def check_adapter_name(name) -> str:
    """`name` if it is a valid adapter name, else InvalidAdapterNameError saying what is wrong."""
    if not isinstance(name, str):
        raise InvalidAdapterNameError(f"an adapter name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidAdapterNameError("an adapter name must not be empty")
    shown = name if len(name) <= 80 else name[:77] + "..."
    segments = name.split("/")
    if len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name) or {"", ".", ".."} & set(segments):
        raise InvalidAdapterNameError(f"invalid adapter name {shown!r}: use {RULE}")
    return name


def parse_adapter_arg(arg: str) -> tuple[str, str]:
    """`"name=path"` -> (name, path), the name checked; a bare path names the adapter after itself (as MAX
    does), so only the name=path form is held to the naming rule. The first "=" splits: paths may hold "="."""
    if "=" not in arg:
        if not arg or "," in arg or any(ord(c) < 32 for c in arg):
            raise ValueError(f"a bare path names the adapter after itself, so it may not hold ',' or control "
                             f"characters; use 'name=path' (got {arg!r})")
        return arg, arg
    name, path = arg.split("=", 1)
    if not name or not path:
        raise ValueError(f"expected 'name=path' or a path, got {arg!r}")
    return check_adapter_name(name), path


@dataclass(frozen=True)
class AdapterRef:
    """One load of an adapter: the name a user gave it and an id no other load in this process ever gets
    (SGLang's LoRARef). A name can be unloaded and loaded again, or reloaded in place; each load is a new
    AdapterRef, so whatever is keyed by it (host copies, slots, a request's adapter) never mixes versions.
    It prints as its name (what users see); repr shows the id."""

    name: str
    id: int = field(default_factory=lambda: next(_load_ids))
    rev: str = field(default_factory=lambda: secrets.token_hex(4), compare=False)
    """The load's revision as users see it (random: unique across engine restarts too, where ids start again)."""

    def __str__(self) -> str:
        return self.name

    @property
    def revision(self) -> str:
        """name@rev: which load of which adapter answered (responses' system_fingerprint)."""
        return f"{self.name}@{self.rev}"


_load_ids = itertools.count(1)
_REVISION = re.compile(r"(.+)@([0-9a-f]{8})")


def split_revision(model: str) -> tuple[str, str] | None:
    """"name@rev" -> (name, rev) where rev is a load's 8 hex digits (AdapterRef.rev); None for any other string.
    A loaded name is looked up as itself first, so a name that happens to end so is never shadowed."""
    match = _REVISION.fullmatch(model)
    return (match[1], match[2]) if match else None


# ---- weighted combinations (adapters/combinations.py builds them) --------------------------------------------
# A combination's name lists its parts in the caller's order, `style*0.5&legal*1.0`: "*" and "&" never appear in an
# adapter's name, so it is never a user's adapter.
PART, WEIGHT = "&", "*"
MAX_PARTS = 8
MAX_WEIGHT = 100.0


class InvalidCombinationError(ValueError):
    """A combination that cannot be served (its message says why; a 400 over HTTP)."""


def is_combination(name: str) -> bool:
    return WEIGHT in name


def combination_name(parts: Mapping[str, float]) -> str:
    """The derived adapter's name for `parts` ({adapter name: weight}, in the caller's order), checked."""
    if not isinstance(parts, Mapping) or not 1 <= len(parts) <= MAX_PARTS:
        raise InvalidCombinationError(f"a combination names 1 to {MAX_PARTS} adapters with their weights")
    for name, weight in parts.items():
        try:
            check_adapter_name(name)
        except InvalidAdapterNameError as e:
            raise InvalidCombinationError(str(e)) from None
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or abs(weight) > MAX_WEIGHT:
            raise InvalidCombinationError(f"adapter {name!r}'s weight in a combination must be a finite number of at "
                                          f"most {MAX_WEIGHT:g} in size, got {weight!r}")
    return PART.join(f"{name}{WEIGHT}{float(weight)!r}" for name, weight in parts.items())


def parse_combination(name: str) -> dict[str, float]:
    """combination_name's inverse (InvalidCombinationError if `name` is not one)."""
    parts = {}
    for part in name.split(PART):
        adapter, _, weight = part.rpartition(WEIGHT)
        try:
            parts[adapter] = float(weight)
        except ValueError:
            raise InvalidCombinationError(f"{part!r} is not adapter{WEIGHT}weight") from None
    if combination_name(parts) != name:
        raise InvalidCombinationError(f"{name!r} is not a combination's name (adapter{WEIGHT}weight parts joined by "
                                      f"{PART!r}, each adapter once)")
    return parts
