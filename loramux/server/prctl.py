"""Linux process controls for the server's processes (no-ops elsewhere): die with the parent, and a name that
`ps -o comm`, `top` and /proc/PID/comm show (loramux-http, loramux-engine, loramux-grammar)."""
from __future__ import annotations

import signal
import sys

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def _prctl(option: int, value) -> None:
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """The kernel sends `sig` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def set_name(name: str) -> None:
    """The process's name as the kernel shows it (15 bytes at most)."""
    if sys.platform == "linux":
        import ctypes

        _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))
