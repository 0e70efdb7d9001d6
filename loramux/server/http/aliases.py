"""Weighted aliases: a `model` name whose requests go to several targets in set shares — revisions of one adapter
(name@rev) or other adapters — for canary rollouts (`POST /v1/lora_aliases`). No torch.

- An alias may have an adapter's own name: it then takes that name's requests (a canary of `acme` sends 10% of
  `acme`'s traffic to its new revision). A target is never read as an alias, so the adapter stays reachable as a
  target, and by name@rev.
- One pick per HTTP request: every prompt and choice of it runs on one target. The pick is a function of the
  request's `user` (OpenAI's field) when it has one, else of its `seed`, else random: the same user stays on the
  same target while the alias is unchanged, and a rollout's requests stay on one revision.
- Kept in a file beside the server's registry (written whole, then renamed), so a front end that replaces a
  killed one has them.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass

from loramux.adapters.names import check_adapter_name, split_revision

MAX_TARGETS = 16


@dataclass(frozen=True)
class Alias:
    name: str
    targets: tuple[tuple[str, float], ...]  # (target, share), shares summing to 1

    def pick(self, key: str | None) -> str:
        """The target for a request keyed by `key` (None: at random)."""
        point = random.random() if key is None else _unit(f"{self.name}\0{key}")
        total = 0.0
        for target, share in self.targets:
            total += share
            if point < total:
                return target
        return self.targets[-1][0]  # (rounding at the top end)


def _unit(text: str) -> float:
    """A number in [0, 1) spread evenly over keys."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def target_name(target: str) -> str:
    """The adapter a target runs: `name` for name or name@rev."""
    revision = split_revision(target)
    return revision[0] if revision is not None else target


def make_alias(name: str, targets: dict) -> Alias:
    """A checked Alias (ValueError saying what is wrong): a valid name, 1 to MAX_TARGETS valid target names, each
    with a finite weight >= 0, not all 0. Weights are made shares (divided by their sum)."""
    check_adapter_name(name)
    if not isinstance(targets, dict) or not 1 <= len(targets) <= MAX_TARGETS:
        raise ValueError(f"an alias needs 1 to {MAX_TARGETS} targets, as {{target: weight}}")
    for target, weight in targets.items():
        check_adapter_name(target)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
            raise ValueError(f"target {target!r}: a weight must be a finite number >= 0, got {weight!r}")
    total = float(sum(targets.values()))
    if total <= 0:
        raise ValueError("an alias's weights must not all be 0")
    return Alias(name, tuple((target, weight / total) for target, weight in targets.items()))


class Aliases:
    def __init__(self, path: str | None = None):
        """path: the file they are kept in (read now if it exists; None: in memory only)."""
        self.path = path
        self._aliases: dict[str, Alias] = {}
        if path is not None and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                for name, targets in json.load(f).items():
                    self._aliases[name] = make_alias(name, targets)

    def get(self, name: str) -> Alias | None:
        return self._aliases.get(name)

    def all(self) -> list[Alias]:
        return list(self._aliases.values())

    def set(self, alias: Alias) -> None:
        self._aliases[alias.name] = alias
        self._save()

    def remove(self, name: str) -> bool:
        found = self._aliases.pop(name, None) is not None
        if found:
            self._save()
        return found

    def _save(self) -> None:
        if self.path is None:
            return
        data = {a.name: dict(a.targets) for a in self._aliases.values()}
        with open(self.path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(self.path + ".tmp", self.path)
