"""AdapterRecords: the registered adapters of a server, name -> AdapterRecord, changed only through its methods.

One class for the single server's front end (its registry, replayed into a restarted engine) and the Ray Serve
registry (the deployment the ingress changes and the replicas follow). The engine is the truth of what is loaded;
this is what a restart replays. Every change makes a new record (records are never changed in place), bumps
`generation` (what Ray replicas report having applied) and is saved through `save` (a file beside the front end,
or the Ray cluster's key-value store). No torch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import msgspec

from loramux.server.engine.wire import AdapterRecord


class AdapterRecords(Mapping):
    def __init__(self, records: Iterable[AdapterRecord] = (), save: Callable[[AdapterRecords], None] | None = None,
                 version: int = 0, generation: int = 0):
        """save(self): called after every change; version: the last version handed out (a record's grows with
        every registration of its name); generation: grows with every change."""
        self._records = {r.name: r for r in records}
        self._save, self.version, self.generation = save, version, generation

    # ---- reads (a Mapping: name -> record) -----------------------------------------------------------------
    def __getitem__(self, name: str) -> AdapterRecord:
        return self._records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    # ---- changes ----------------------------------------------------------------------------------------
    def register(self, record: AdapterRecord) -> tuple[AdapterRecord, AdapterRecord | None]:
        """`record` under its name, with the next version: (the new record, the one it replaces)."""
        old = self._records.get(record.name)
        self.version += 1
        new = self._records[record.name] = msgspec.structs.replace(record, version=self.version)
        self._changed()
        return new, old

    def put_back(self, name: str, old: AdapterRecord | None) -> None:
        """Undo a registration (`old`: what it replaced, which comes back with a new version; None: nothing)."""
        if old is None:
            self._records.pop(name, None)
            self._changed()
        else:
            self.register(old)

    def remove(self, name: str) -> AdapterRecord | None:
        """The record `name` had (None: not registered)."""
        record = self._records.pop(name, None)
        if record is not None:
            self._changed()
        return record

    def set_pinned(self, name: str, pinned: bool) -> bool:
        """Whether `name` is registered (its pin set)."""
        if name not in self._records:
            return False
        self._records[name] = msgspec.structs.replace(self._records[name], pinned=pinned)
        self._changed()
        return True

    def keep(self, wanted: Callable[[AdapterRecord], bool]) -> None:
        """Drop the records that are not `wanted`."""
        self._records = {name: r for name, r in self._records.items() if wanted(r)}
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        if self._save is not None:
            self._save(self)
