"""Building the C++ kernels: a build that was killed never makes later starts wait forever."""
import concurrent.futures
import os
import shutil
import subprocess
import sys

import torch.utils.cpp_extension

from loramux.ops import cpu_extension
from support.serving import wait_until


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
    """The live build (another process holding the flock) ends only when the test says so: the build here is
    seen waiting in the kernel's lock table meanwhile, and it goes on, finding no `lock`, only after."""
    build_dir = tmp_path / "kernel"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")  # a live build's lock, under the flock its process holds
    flock = build_dir / "loramux.flock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys\n"
        f"f = open({str(flock)!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); sys.stdin.readline()\n"
        f"os.remove({str(build_dir / 'lock')!r})\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda name, **kwargs: seen.append(os.path.exists(build_dir / "lock")) or name)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        build = pool.submit(cpu_extension._build, "loramux_k", "k.cpp", str(build_dir), [])
        wait_until(lambda: _blocked_on(flock), 60, "the build waiting on the live build's flock")
        assert not build.done() and seen == []
        holder.stdin.write("done\n")
        holder.stdin.flush()
        assert build.result(timeout=60) == "loramux_k"
    assert seen == [False]  # it went on after the live build, whose lock was still there for it to remove itself
    assert holder.wait() == 0


def _blocked_on(path) -> bool:
    """Whether some process waits for an flock on `path` (a "->" line of /proc/locks names its inode)."""
    inode = f":{os.stat(path).st_ino} "
    with open("/proc/locks") as f:
        return any("->" in line and "FLOCK" in line and inode in line for line in f)


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
