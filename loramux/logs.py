"""Where loramux's own log lines go when it runs as a program (loramux serve, its engine process, its front
ends): below every module that logs, so that each process can set it up without importing a layer above it."""
from __future__ import annotations

import logging


def log_to_stderr(level: str) -> None:
    """uvicorn configures its own loggers only: loramux's (a request's `user`, adapters that failed to load,
    the engine's supervision, shutdown) go to stderr at --log-level too."""
    logger = logging.getLogger("loramux")
    if not any(getattr(h, "loramux_cli", False) for h in logger.handlers):  # once per process
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        handler.loramux_cli = True
        logger.addHandler(handler)
    logger.setLevel("DEBUG" if level == "trace" else level.upper())  # trace: uvicorn's own, below debug
    logger.propagate = False  # the root logger's handlers, if any, would print it twice
