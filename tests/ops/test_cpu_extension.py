"""Building the C++ kernels: a build that was killed never makes later starts wait forever."""
import os
import shutil
import subprocess
import sys
import time

import torch.utils.cpp_extension

from loramux.ops import cpu_extension


def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_goes_on(tmp_path, monkeypatch):
    build_dir = tmp_path / "kernel"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")  # what torch leaves when its build is killed: it would wait forever
    seen = []

    def load(name, sources, build_directory, **kwargs):
        seen.append(os.path.exists(os.path.join(build_directory, "lock")))
        return name

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    assert cpu_extension._build("loramux_k", "k.cpp", str(build_dir), []) == "loramux_k"
    assert seen == [False]


def test_a_live_build_is_waited_for_not_broken_into(tmp_path, monkeypatch):
    build_dir = tmp_path / "kernel"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")  # a live build's lock, under the flock its process holds
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"f = open({str(build_dir / 'loramux.flock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(1.0)\n"
        f"os.remove({str(build_dir / 'lock')!r})\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    started = time.monotonic()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, **kwargs: name)
    assert cpu_extension._build("loramux_k", "k.cpp", str(build_dir), []) == "loramux_k"
    assert time.monotonic() - started > 0.5  # it waited for the live build to finish
    assert holder.wait() == 0  # whose lock was still there for it to remove itself


def test_two_checkouts_sharing_a_cache_build_into_their_own_directories(tmp_path, monkeypatch):
    """torch rebuilds a kernel whenever its build command changes, and the command names the source's path:
    one build directory for two checkouts of the same sources would be rebuilt by each in turn, every start."""
    built = []
    monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: {"avx512f", "avx512bw", "avx512_bf16"})
    monkeypatch.setattr(cpu_extension, "_build", lambda module, source, build_dir, cflags: built.append(build_dir))
    for checkout in ("a", "b", "a"):
        csrc = tmp_path / checkout / "csrc"
        if not csrc.exists():
            shutil.copytree(cpu_extension.CSRC, csrc)
        monkeypatch.setattr(cpu_extension, "CSRC", str(csrc))
        cpu_extension.load_extension.__wrapped__("lora_cpu")
    assert built[0] != built[1] and built[0] == built[2]
