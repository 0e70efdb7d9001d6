"""`loramux serve`'s top process: it holds the listening socket and runs the HTTP front end (which runs the
engine process) as a child, and starts a new one if that child dies of anything but a clean stop.

    loramux serve (supervise: the socket, restarts)
      └─ front end process (uvicorn + FastAPI, server/http/app.py), given the socket
           └─ engine process (server/engine/engine_process.py)

The front end keeps its adapter registry (what was loaded at run time, and pins) in a state file the
supervisor owns, so the one that replaces it serves the same adapters; connections that arrive meanwhile wait
in the socket's backlog and are answered by the new front end (503 with the reason until its engine is up).
`loramux:frontend_restarts` counts the restarts. SIGTERM or Ctrl-C is passed to the front end as one SIGTERM
per signal (the first drains, a second stops at once); its exit code is the server's. SIGHUP is passed on
too: the front end reads its tenants file again.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace

from loramux.config import EngineConfig, ServerConfig
from loramux.server.engine import prctl

logger = logging.getLogger("loramux.server")
STARTUP_FAILED = 3  # as uvicorn.run: the server never started (a bad model path, a taken port, ...)
BACKOFF_S = (0.5, 10.0)  # first and longest wait before starting a new front end


def supervise(engine_config: EngineConfig, config: ServerConfig, lora_modules: list[str], log_level: str) -> int:
    """Serve until stopped; the exit code."""
    sock = listening_socket(config)
    config = replace(config, host=sock.getsockname()[0], port=sock.getsockname()[1])  # (an inherited one's, logged)
    state_dir = tempfile.mkdtemp(prefix="loramux-state-")
    supervisor = _Supervisor(sock, (engine_config, config, list(lora_modules), log_level,
                                    os.path.join(state_dir, "registry.json")))
    try:
        return supervisor.run()
    finally:
        sock.close()
        shutil.rmtree(state_dir, ignore_errors=True)


def listening_socket(config: ServerConfig) -> socket.socket:
    """The socket to serve on: host:port bound here, or the inherited one (config.listen_fd), which must be a
    listening TCP socket. OSError if the port is taken; ValueError for a descriptor that is no such socket."""
    if config.listen_fd is None:
        return socket.create_server((config.host, config.port), backlog=2048)
    try:
        sock = socket.socket(fileno=config.listen_fd)
    except OSError as e:
        raise ValueError(f"--listen-fd {config.listen_fd}: not an open socket ({e.strerror})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) or \
            not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ValueError(f"--listen-fd {config.listen_fd}: not a listening TCP socket")
    return sock


class _Supervisor:
    def __init__(self, sock: socket.socket, settings: tuple):
        self.sock, self.settings = sock, settings
        self.child: multiprocessing.Process | None = None
        self.stopping = False
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)
        signal.signal(signal.SIGHUP, self._reload)

    def _reload(self, *_) -> None:
        """SIGHUP: the front end reads its tenants file again (requests in flight go on)."""
        if self.child is not None and self.child.pid is not None and self.child.is_alive():
            os.kill(self.child.pid, signal.SIGHUP)

    def _forward(self, *_) -> None:
        self.stopping = True
        if self.child is not None and self.child.pid is not None and self.child.is_alive():
            os.kill(self.child.pid, signal.SIGTERM)

    def run(self) -> int:
        restarts, delay = 0, BACKOFF_S[0]
        while True:
            started = time.monotonic()
            code = self._run_child(restarts)
            if self.stopping or code == 0 or (code == STARTUP_FAILED and restarts == 0):
                return code
            if time.monotonic() - started > 60:
                delay = BACKOFF_S[0]  # it had been up a while: this is not a crash loop
            restarts += 1
            logger.error("the HTTP front end exited (code %s); starting a new one in %.1f s (restart %d)", code,
                         delay, restarts)
            time.sleep(delay)
            delay = min(2 * delay, BACKOFF_S[1])

    def _run_child(self, restarts: int) -> int:
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of a dead one's state
        self.child = spawn.Process(target=_frontend_main, args=(self.sock, *self.settings, restarts),
                                   name="loramux-frontend")
        self.child.start()
        self.child.join()
        return self.child.exitcode


def _frontend_main(sock: socket.socket, engine_config: EngineConfig, config: ServerConfig, lora_modules: list[str],
                   log_level: str, state_file: str, restarts: int) -> None:
    """The front end process: uvicorn on the supervisor's socket. It dies with the supervisor."""
    prctl.die_with_parent(signal.SIGKILL)
    prctl.set_name("loramux-http")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor passes Ctrl-C on as SIGTERM
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the app's handler (a reload of its tenants) is set
    # A worker thread building a large response holds the GIL for up to the switch interval at a time; the
    # event loop, which every other client's request goes through, should wait 1 ms for it, not 5.
    sys.setswitchinterval(0.001)
    from loramux.logs import log_to_stderr
    from loramux.server.http.app import build_app, run_server

    log_to_stderr(log_level)
    app = build_app(engine_config, config, lora_modules, state_file=state_file, restarts=restarts)
    sys.exit(run_server(app, config, log_level, sockets=[sock]))
