"""SpillFile: host copies that left host memory come back from it exactly as they were built (every tensor's
dtype, shape, strides and bytes), within its byte budget, least recently read first out, and with its extents
reused; it never serves a forgotten identity, and a disk it cannot write to only turns it off."""
import os

import pytest
import torch

from loramux.adapters.checkpoint import AdapterWeights, ModuleLoRA
from loramux.adapters.names import AdapterRef
from loramux.adapters.peft_config import AdapterSpec
from loramux.adapters.spill import ALIGN, SpillFile

SPEC = AdapterSpec.from_dict({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})


def adapter(seed: int, modules: int = 3, dora: bool = False, copy: bool = False) -> AdapterWeights:
    """As built: A's as views of one stack, B's as transposed views of a rank-major one (checkpoint._Stack),
    DoRA scales in fp32, a whole-module copy."""
    g = torch.Generator().manual_seed(seed)
    a_stack = torch.randn(4 * modules, 16, generator=g).to(torch.bfloat16)
    b_major = torch.randn(4, 8 * modules, generator=g).to(torch.bfloat16)
    built = {}
    for i in range(modules):
        scale = torch.rand(8, generator=g) if dora else None
        built[f"model.layers.{i}.self_attn.q_proj"] = ModuleLoRA(a_stack[4 * i:4 * i + 4], b_major[:, 8 * i:8 * i + 8].t(), scale)
    copies = {"lm_head": torch.randn(32, 16, generator=g)} if copy else {}
    return AdapterWeights(name=f"a{seed}", spec=SPEC, modules=built, path="/x", copies=copies, digest=f"d{seed}")


def assert_same(got: AdapterWeights, want: AdapterWeights) -> None:
    assert (got.name, got.spec, got.path, got.digest, list(got.modules), list(got.copies)) == \
           (want.name, want.spec, want.path, want.digest, list(want.modules), list(want.copies))
    assert [m.scale is None for m in got.modules.values()] == [m.scale is None for m in want.modules.values()]
    for g, w in zip(got.tensors(), want.tensors(), strict=True):
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
        assert torch.equal(g, w)


def spilled(spill: SpillFile, ref: AdapterRef, weights: AdapterWeights) -> None:
    spill.hold(ref, weights)
    assert spill.pending and spill.read(ref) is weights  # held, not written yet: the copy itself
    spill.flush()
    assert not spill.pending


@pytest.mark.parametrize("kind", [{}, {"dora": True}, {"copy": True}])
def test_a_copy_comes_back_as_it_was_built(tmp_path, kind):
    spill, ref, weights = SpillFile(str(tmp_path / "spill"), 1 << 30), AdapterRef("a"), adapter(1, **kind)
    spilled(spill, ref, weights)
    got = spill.read(ref)
    assert got is not weights and len(spill) == 1
    assert_same(got, weights)
    assert got.structure() == weights.structure()
    assert all(t.untyped_storage().data_ptr() == got.tensors()[0].untyped_storage().data_ptr()
               for t in got.tensors())  # one read: views of one buffer
    assert os.listdir(tmp_path / "spill") == []  # the file has no name: it goes with the process


def test_a_forgotten_identity_is_never_served_and_its_extent_is_reused(tmp_path):
    spill = SpillFile(str(tmp_path), 1 << 30)
    first, second, third = AdapterRef("a"), AdapterRef("b"), AdapterRef("c")
    spilled(spill, first, adapter(1))
    spilled(spill, second, adapter(2))
    size = spill.nbytes
    spill.forget(first)
    assert spill.read(first) is None and spill.nbytes == size // 2
    spilled(spill, third, adapter(3))  # first fit: first's extent
    assert spill._end == size
    assert_same(spill.read(second), adapter(2))
    assert_same(spill.read(third), adapter(3))
    spill.hold(first, adapter(1))
    spill.forget(first)  # gone before it was written
    spill.flush()
    assert spill.read(first) is None and len(spill) == 2
    assert len(spill._shared) == 2  # adapters of one shape: one structure and one layout kept for all
    spill.forget(second)
    spill.forget(third)
    assert spill._shared == {} and spill.nbytes == 0 and spill._end == 0


def test_the_budget_drops_the_least_recently_read_first(tmp_path):
    one = SpillFile(str(tmp_path), 1 << 30)
    spilled(one, AdapterRef("x"), adapter(0))
    spill = SpillFile(str(tmp_path), 2 * one.nbytes)
    refs = [AdapterRef(f"a{i}") for i in range(3)]
    spilled(spill, refs[0], adapter(0))
    spilled(spill, refs[1], adapter(1))
    assert spill.read(refs[0]) is not None  # read more recently than refs[1]
    spilled(spill, refs[2], adapter(2))
    assert spill.read(refs[1]) is None
    assert_same(spill.read(refs[0]), adapter(0))
    assert_same(spill.read(refs[2]), adapter(2))
    assert spill.nbytes <= spill.max_bytes and spill.nbytes % ALIGN == 0


def test_off_and_too_large_keep_nothing(tmp_path):
    off = SpillFile(str(tmp_path), 0)
    off.hold(AdapterRef("a"), adapter(1))
    assert not off.pending and len(off) == 0
    small = SpillFile(str(tmp_path), 100)  # less than one copy
    ref = AdapterRef("a")
    small.hold(ref, adapter(1))
    small.flush()
    assert small.read(ref) is None and len(small) == 0


def test_a_directory_it_cannot_write_turns_it_off_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    spill = SpillFile(str(blocker / "spill"), 1 << 30)
    refs = [AdapterRef("a"), AdapterRef("b")]
    for ref in refs:
        spill.hold(ref, adapter(1))
        spill.flush()
        assert spill.read(ref) is None
    assert spill.max_bytes == 0
    assert sum("cannot keep adapters' host copies" in r.message for r in caplog.records) == 1


def test_a_read_whose_entry_goes_meanwhile_is_thrown_away(tmp_path, monkeypatch):
    """The step loop may read a copy back itself while the loader thread writes another one, which may take a
    dropped entry's extent: a read whose entry went during it is not trusted."""
    from loramux.adapters import spill as spill_module

    spill, ref = SpillFile(str(tmp_path), 1 << 30), AdapterRef("a")
    spilled(spill, ref, adapter(1))
    real = os.preadv

    def preadv(fd, buffers, offset):
        spill.forget(ref)  # as the loader thread would drop it, then reuse its extent
        return real(fd, buffers, offset)

    monkeypatch.setattr(spill_module.os, "preadv", preadv)
    assert spill.read(ref) is None


def test_a_digest_alone_is_the_digest_of_a_read(adapter_dirs, tmp_path):
    """A read-back of files whose look cannot be trusted (copied a moment before they were loaded) hashes them,
    and when the digest is the load's, takes the spilled copy: that digest must be the one a read takes, for a
    directory (safetensors, or pickle when allowed) and a lone .safetensors file (with a sidecar or not)."""
    import shutil

    from safetensors.torch import load_file

    from loramux.adapters.files import digest_adapter, read_adapter

    directory = adapter_dirs["llama", "r4"]
    pickled = shutil.copytree(directory, tmp_path / "pickled")
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    os.remove(pickled / "adapter_model.safetensors")
    lone = tmp_path / "lone" / "x.safetensors"
    lone.parent.mkdir()
    shutil.copy(os.path.join(directory, "adapter_model.safetensors"), lone)
    sidecar = tmp_path / "sidecar" / "adapter_model.safetensors"
    shutil.copytree(directory, sidecar.parent)
    for path, kwargs in [(directory, {}), (str(pickled), {"allow_pickle": True}), (str(lone), {}),
                         (str(sidecar), {})]:
        read = read_adapter(path, lora_alpha=16 if path == str(lone) else None, **kwargs)
        assert digest_adapter(path, **kwargs) == read.digest != ""
    with pytest.raises(Exception):
        digest_adapter(str(pickled))  # pickle not allowed: as a read, refused
