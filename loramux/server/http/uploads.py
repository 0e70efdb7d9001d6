"""Adapters uploaded in the body of /v1/load_lora_adapter (multipart form data: adapter_config.json and
adapter_model.safetensors parts). Their files are written under one directory the server owns and loaded from
there as a runtime load is: every check of adapter files applies to them, an adapter evicted from host memory is
read back from them, and an engine restart loads them again (the registry keeps their path).

Each upload is a directory of its own. A name keeps the directories of its current upload, of the earlier
revisions the engine keeps, and of one more (requests still running on the revision that just left may read it
back); older ones go at the next upload of the name, all of them when it is unloaded.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import BinaryIO

from loramux.adapters.file_names import CONFIG_FILE, SAFETENSORS_FILE

class Uploads:
    def __init__(self, root: str, kept_per_name: int = 2):
        os.makedirs(root, mode=0o700, exist_ok=True)
        self.root = os.path.realpath(root)
        self.kept_per_name = kept_per_name
        self._dirs: dict[str, list[str]] = {}  # name -> its upload directories, oldest first

    def save(self, config: bytes, weights: BinaryIO) -> str:
        """A new directory with the two files (blocking: run it off the event loop)."""
        path = tempfile.mkdtemp(prefix="upload-", dir=self.root)
        with open(os.path.join(path, CONFIG_FILE), "wb") as f:
            f.write(config)
        with open(os.path.join(path, SAFETENSORS_FILE), "wb") as f:
            shutil.copyfileobj(weights, f, 1 << 20)
        return path

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
