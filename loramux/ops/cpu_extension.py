"""Builds the C++ CPU kernels in csrc/ once, on first use, and caches them under the user's cache dir.

Each build (~30 s; needs a C++ compiler and ninja) is keyed by its source and the torch version. On a
CPU without AVX-512 BF16, or where the build fails, `load_extension` returns None and callers use
their pure-torch reference instead.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import glob
import hashlib
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator

import torch

from loramux.config import cache_dir

logger = logging.getLogger(__name__)
CSRC = os.path.join(os.path.dirname(__file__), "csrc")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
KERNEL_CPU_FLAGS = {"quant_cpu": ("avx2", "fma", "f16c")}  # plain loops the compiler vectorizes: AVX2 is enough
# quant_cpu decodes weights bit for bit as gguf-py does (a * q + b rounded twice): no contraction into FMAs
KERNEL_CFLAGS = {"quant_cpu": ["-ffp-contract=off"]}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _put_ninja_on_path() -> None:
    """torch looks for `ninja` on PATH; the pip package's binary sits in a venv that may not be active."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load_extension(name: str):
    """The compiled module for csrc/<name>.cpp, or None where this machine cannot build or run it."""
    missing = [flag for flag in KERNEL_CPU_FLAGS.get(name, REQUIRED_CPU_FLAGS) if flag not in _cpu_flags()]
    if missing:
        logger.info("CPU kernel %s off: this CPU lacks %s", name, ", ".join(missing))
        return None
    _put_ninja_on_path()
    source = os.path.join(CSRC, f"{name}.cpp")
    cflags = ["-O3", "-march=native", "-fopenmp", *KERNEL_CFLAGS.get(name, [])]
    # keyed by where the sources and torch live too: torch's load() rebuilds whenever its build command changes,
    # so two checkouts (or venvs) sharing one cache dir would otherwise rebuild each other's kernels on every start
    digest = hashlib.sha256("\0".join([torch.__version__, torch.__file__, CSRC, *cflags]).encode())
    for path in [source] + sorted(glob.glob(os.path.join(CSRC, "*.h"))):  # shared headers rebuild every kernel
        with open(path, "rb") as f:
            digest.update(f.read())
    digest = digest.hexdigest()[:12]
    build_dir = os.path.join(cache_dir(), "torch_extensions", f"{name}_{digest}")
    try:
        return _build(f"loramux_{name}_{digest}", source, build_dir, cflags)
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        logger.warning("CPU kernel %s could not be built (%s); using the torch path", name, e)
        return None


def _build(module: str, source: str, build_dir: str, cflags: list[str]):
    """torch's load() under an flock on the build directory. torch guards a build with a `lock` file and
    waits, forever, while one exists; a build that was killed (Ctrl-C on a first start, a killed test run)
    leaves it behind. Every loramux build holds the flock, which the kernel releases when its holder dies, so
    a `lock` file found while holding it belongs to no live build and is removed."""
    from torch.utils.cpp_extension import load

    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "loramux.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a kernel build that did not finish", stale)
            os.remove(stale)
        if not glob.glob(os.path.join(build_dir, f"{module}*.so")):
            logger.warning("building the CPU kernel %s (first start only; 15-30 s)", module)
        return load(name=module, sources=[source], build_directory=build_dir, extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"])


def build(name: str) -> tuple[str, bool, float]:
    """Build csrc/<name>.cpp in this process (or find it built): (name, usable on this machine, seconds)."""
    started = time.monotonic()
    return name, load_extension(name) is not None, time.monotonic() - started


def build_all() -> Iterator[tuple[str, bool, float]]:
    """Every kernel, as `build` gives it, in the order they finish. One compiler runs per core at once: a
    kernel is one translation unit, so its build keeps one core busy (five kernels one after another: ~95 s
    on 2-core Zen 4; two at a time: ~55 s)."""
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")), key=os.path.getsize, reverse=True)  # longest first
    names = [os.path.basename(path)[:-4] for path in sources]
    context = multiprocessing.get_context("spawn")  # fresh interpreters: nothing of this one's threads forked
    with concurrent.futures.ProcessPoolExecutor(min(len(names), os.cpu_count() or 1), mp_context=context) as pool:
        yield from (done.result() for done in concurrent.futures.as_completed([pool.submit(build, n) for n in names]))
