"""Reading PEFT directories: every refusal names its cause."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_peft_adapter, tiny_llama
from loramux.adapters.checkpoint import build_adapter
from loramux.adapters.files import AdapterPathError, read_adapter_dir
from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name, parse_adapter_arg
from loramux.adapters.peft_config import InvalidAdapterError

SHAPES = {f"model.layers.{i}.self_attn.{p}": (64, 64 if p in ("q_proj", "o_proj") else 32)
          for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


@pytest.mark.parametrize(
    "arg, expected",
    [("pirate=/a/b", ("pirate", "/a/b")), ("/a/b", ("/a/b", "/a/b")), ("x=/a=b", ("x", "/a=b"))],
)
def test_parse_adapter_arg(arg, expected):
    assert parse_adapter_arg(arg) == expected


@pytest.mark.parametrize("arg", ["=/a", "name=", "", "/a,b", "/a\x00b"])
def test_parse_adapter_arg_refuses_empty_parts_and_unusable_paths(arg):
    with pytest.raises(ValueError, match="name=path"):
        parse_adapter_arg(arg)


@pytest.mark.parametrize("name", ["pirate", "org/adapter-v1.2", "a_b:c@d+e", "7", "a0.", "acme/legal/v.2"])
def test_adapter_names_allowed(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name", ["", "x=/elsewhere/e", "a,b", "a b", "tab\t", "nul\x00", "/abs", "../up", "a/../b",
                                  ".hidden", "~home", "é", "x" * 129, 5, None,
                                  # spellings of another name's path: one canonical name per adapter
                                  "a0/.", "a0/", "a0//", "acme/./legal", "acme//legal", "a0/./", "acme/legal/."])
def test_adapter_names_refused(name):
    with pytest.raises(InvalidAdapterNameError, match="adapter name"):
        check_adapter_name(name)


def test_name_in_name_path_form_is_checked_but_the_path_may_hold_equals():
    with pytest.raises(InvalidAdapterNameError):
        parse_adapter_arg("a,b=/p")
    assert parse_adapter_arg("x=/a=b") == ("x", "/a=b")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return save_peft_adapter(tiny_llama(), tmp_path_factory.mktemp("qv"), r=8, target_modules=["q_proj", "v_proj"])


def copy_adapter(adapter, tmp_path):
    return shutil.copytree(adapter, tmp_path / "copy")


def edit_config(path, **changes):
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def test_reads_safetensors_and_folds_scaling(adapter):
    config, tensors = read_adapter_dir(adapter)
    weights = build_adapter("a", config, tensors, SHAPES, max_rank=64)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    module = weights.modules["model.layers.0.self_attn.q_proj"]
    assert torch.equal(module.b, tensors[key] * (16 / 8)) and module.rank == 8
    assert len(weights.modules) == 4


@pytest.mark.parametrize("path, words", [("/nonexistent/x", ["does not exist"]), ("{empty}", ["no adapter_config.json"]),
                                              ("{empty}/file", ["is a file", "adapter's directory"]), ("a\x00b", ["invalid"])])
def test_bad_paths(tmp_path, path, words):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterPathError) as err:
        read_adapter_dir(path.format(empty=tmp_path))
    assert all(w in str(err.value) for w in words)


def test_missing_weights_and_bad_json(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    os.remove(path / "adapter_model.safetensors")
    with pytest.raises(AdapterPathError, match="neither adapter_model.safetensors"):
        read_adapter_dir(str(path))
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidAdapterError, match="not valid JSON"):
        read_adapter_dir(str(path))


def test_pickle_is_refused_unless_allowed_and_then_weights_only(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    os.remove(path / "adapter_model.safetensors")
    torch.save(tensors, path / "adapter_model.bin")
    with pytest.raises(InvalidAdapterError, match="refusing to unpickle"):
        read_adapter_dir(str(path))
    _, loaded = read_adapter_dir(str(path), allow_pickle=True)
    assert loaded.keys() == tensors.keys()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, path / "adapter_model.bin", _use_new_zipfile_serialization=True)
    with pytest.raises(InvalidAdapterError, match="weights_only=True"):
        read_adapter_dir(str(path), allow_pickle=True)


def test_unreadable_safetensors(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(InvalidAdapterError, match="not a safetensors file"):
        read_adapter_dir(str(path))


def build(adapter, shapes=SHAPES, max_rank=64, **config_changes):
    config, tensors = read_adapter_dir(adapter)
    return build_adapter("a", {**config, **config_changes}, tensors, shapes, max_rank=max_rank)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_rank=4), ["rank 8", "max_lora_rank=4"]),
        (dict(shapes={k: v for k, v in SHAPES.items() if "v_proj" not in k}), ["v_proj", "does not wrap"]),
        (dict(shapes={k: (64, 48) for k in SHAPES}), ["q_proj", "lora_B (64, 8)", "[48, r]"]),
        (dict(r=4), ["rank 8 in its weights but 4"]),
        (dict(use_qalora=True, bias="lora_only"), ["QALoRA", "bias='lora_only'"]),
        (dict(target_modules=["o_proj"]), ["weights for modules its adapter_config.json does not target", "q_proj"]),
    ],
)
def test_invalid_adapters_name_the_cause(adapter, kwargs, words):
    with pytest.raises(InvalidAdapterError) as err:
        build(adapter, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_embedding_lora_and_missing_pair_are_refused(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 128)
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(InvalidAdapterError, match="lora_embedding_A"):
        build(str(path))
    del tensors["base_model.model.model.embed_tokens.lora_embedding_A"]
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(InvalidAdapterError, match="lora_A but not its pair"):
        build(str(path))


def write_tensors(path, tensors):
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.float64])
def test_weights_of_a_non_float_or_double_dtype_are_refused_naming_the_tensor(adapter, tmp_path, dtype):
    path = copy_adapter(adapter, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    tensors[key] = tensors[key].to(dtype)
    write_tensors(path, tensors)
    with pytest.raises(InvalidAdapterError) as err:
        build(str(path))
    assert key in str(err.value) and str(dtype).removeprefix("torch.") in str(err.value)


def test_duplicate_header_keys_and_bad_length_fields_are_refused(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    file = path / "adapter_model.safetensors"
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    key = next(k for k in header if k != "__metadata__")
    text = json.dumps(header)
    doubled = text[:-1] + f', "{key}": ' + json.dumps(header[key]) + "}"  # the same key twice
    doubled = doubled.encode().ljust(len(text.encode()) + len(doubled) - len(text))
    file.write_bytes(len(doubled).to_bytes(8, "little") + doubled + data[8 + length:])
    with pytest.raises(InvalidAdapterError, match="duplicate keys"):
        read_adapter_dir(str(path))
    for prefix in (b"", b"\x01\x02", (10**15).to_bytes(8, "little"), (0).to_bytes(8, "little")):
        file.write_bytes(prefix + data[8:])
        with pytest.raises(InvalidAdapterError, match="not a safetensors file"):
            read_adapter_dir(str(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_module_gets_its_own_scaling_folded_into_b_across_widths_and_ranks(tmp_path, dtype):
    """The whole adapter is scaled, checked and cast in a few ops (modules stacked by width): each module still
    gets b x its own scaling (in fp32, then cast) and its own a, whatever its width, rank or file dtype."""
    path = save_peft_adapter(tiny_llama(), tmp_path / "mixed", r=8, lora_alpha=16, target_modules=["q_proj", "k_proj",
                             "v_proj", "o_proj"], rank_pattern={"k_proj": 4}, alpha_pattern={"v_proj": 3, "o_proj": 40})
    config, tensors = read_adapter_dir(path)
    tensors = {k: v.to(torch.bfloat16) if "q_proj" in k else v for k, v in tensors.items()}  # a file of two dtypes
    weights = build_adapter("a", config, dict(tensors), SHAPES, max_rank=64, dtype=dtype)
    assert len(weights.modules) == len(SHAPES)
    scalings = {"q_proj": 16 / 8, "k_proj": 16 / 4, "v_proj": 3 / 8, "o_proj": 40 / 8}
    for module, lora in weights.modules.items():
        a = tensors[f"base_model.model.{module}.lora_A.weight"]
        b = tensors[f"base_model.model.{module}.lora_B.weight"]
        scaling = scalings[module.rsplit(".", 1)[-1]]
        assert lora.a.dtype == lora.b.dtype == dtype
        assert torch.equal(lora.a, a.to(dtype))
        assert torch.equal(lora.b, (b.to(torch.float32) * scaling).to(dtype))


# In a process of its own: a thread that another test left starting would be counted too.
_BUILD_OFF_THE_MAIN_THREAD = """
import os, threading, torch
from loramux.adapters.checkpoint import build_adapter, config_from_tensors
shapes = {f"model.layers.{i}.self_attn.{p}": (1024, 1024) for i in range(8) for p in ("q_proj", "o_proj")}
tensors = {f"base_model.model.{m}.lora_{ab}.weight": torch.randn(*((8, 1024) if ab == "A" else (1024, 8)))
           for m in shapes for ab in "AB"}  # 16 A's of one width: 131,072 elements, 4x torch's grain size
config = config_from_tensors(tensors, 16, "x.safetensors")
torch.ones(1 << 20).mul_(2)  # the main thread's own team, if it starts one, before counting
before = set(os.listdir("/proc/self/task"))
built = []
reader = threading.Thread(target=lambda: built.append(build_adapter("a", config, tensors, shapes, 8, torch.bfloat16)))
reader.start()
reader.join()  # (returns as the thread ends: it may still be listed for a moment, so it is not counted)
print(len(built[0].modules), len(set(os.listdir("/proc/self/task")) - before - {str(reader.native_id)}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_an_adapter_built_off_the_main_thread_starts_no_openmp_threads():
    """Reads run on the engine's loader thread beside the step's OpenMP team: an op of theirs that went
    parallel would start a team of its own, whose threads spin on the cores the step computes on."""
    out = subprocess.run([sys.executable, "-c", _BUILD_OFF_THE_MAIN_THREAD], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    modules, started = map(int, out.stdout.split())
    assert modules == 16 and started == 0


def test_every_module_with_a_bad_value_is_named(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    for key in ("base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
                "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"):
        tensors[key][1, 1] = float("nan")
    write_tensors(path, tensors)
    with pytest.raises(InvalidAdapterError) as err:
        build(str(path))
    assert "layers.0.self_attn.v_proj.lora_A.weight has NaN" in str(err.value)
    assert "layers.1.self_attn.q_proj.lora_B.weight (scaling 2 folded in) has NaN" in str(err.value)


@pytest.mark.parametrize("value, words", [(float("nan"), "NaN"), (float("inf"), "Inf"), (1e18, "e+18")])
@pytest.mark.parametrize("which", ["A", "B"])
def test_non_finite_or_huge_weights_are_refused(adapter, tmp_path, value, words, which):
    path = copy_adapter(adapter, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    key = f"base_model.model.model.layers.0.self_attn.q_proj.lora_{which}.weight"
    tensors[key][0, 0] = value
    write_tensors(path, tensors)
    with pytest.raises(InvalidAdapterError) as err:
        build(str(path))
    assert words in str(err.value) and f"q_proj.lora_{which}.weight" in str(err.value)


@pytest.mark.parametrize("changes, words", [
    (dict(r=8.7), "r must be a positive integer, got 8.7"),
    (dict(r=0), "r must be a positive integer, got 0"),
    (dict(r=True), "r must be a positive integer"),
    (dict(r="8"), "r must be a positive integer"),
    (dict(lora_alpha=float("nan")), "lora_alpha must be a finite number"),
    (dict(lora_alpha=float("inf")), "lora_alpha must be a finite number"),
    (dict(lora_alpha="16"), "lora_alpha must be a finite number"),
    (dict(target_modules=5), "target_modules must be a list of module names or a regex string"),
    (dict(target_modules=["q_proj", 3]), "target_modules must be a list"),
    (dict(target_modules="(unclosed"), "not a valid regular expression"),
    (dict(rank_pattern={"q_proj": 0}), "rank_pattern['q_proj'] must be a positive integer"),
    (dict(alpha_pattern={"q_proj": float("nan")}), "alpha_pattern['q_proj'] must be a finite number"),
    (dict(rank_pattern=[1]), "rank_pattern must map"),
    (dict(layers_to_transform=["0"]), "layers_to_transform must be"),
    (dict(use_rslora="yes"), "use_rslora must be true or false"),
])
def test_malformed_config_values_name_the_field(adapter, changes, words):
    with pytest.raises(InvalidAdapterError) as err:
        build(adapter, **changes)
    assert words in str(err.value)


def test_all_linear_and_the_list_form_are_refused_alike_when_a_module_is_not_wrapped(tmp_path):
    """"all-linear" means every Linear of the model (as in PEFT), not only the wrapped ones: an adapter with
    weights for an unwrapped module is refused in both forms, never served without them."""
    base = tiny_llama()
    listed = save_peft_adapter(base, tmp_path / "listed", target_modules=["q_proj", "down_proj"])
    every = save_peft_adapter(base, tmp_path / "every", target_modules="all-linear")
    edit_config(every, target_modules="all-linear")  # PEFT saves the expanded list; older configs hold the word
    wrapped = {k: v for k, v in SHAPES.items() if "q_proj" in k}  # serving with target_modules=("q_proj",)
    all_linear = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    for path in (listed, every):
        config, tensors = read_adapter_dir(path)
        with pytest.raises(InvalidAdapterError, match="down_proj.*does not wrap"):
            build_adapter("a", config, tensors, wrapped, max_rank=64, all_linear=all_linear)


def test_files_are_resolved_inside_the_allowed_dirs_one_by_one(adapter, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(adapter, outside)
    inside = allowed / "pirate"
    inside.mkdir(parents=True)
    shutil.copy(outside / "adapter_config.json", inside)
    os.symlink(outside / "adapter_model.safetensors", inside / "adapter_model.safetensors")
    with pytest.raises(AdapterPathError, match="outside the allowed adapter directories"):
        read_adapter_dir(str(inside), allowed_dirs=(str(allowed),))
    os.remove(inside / "adapter_model.safetensors")
    shutil.copy(outside / "adapter_model.safetensors", inside)
    os.remove(inside / "adapter_config.json")
    os.symlink(outside / "adapter_config.json", inside / "adapter_config.json")
    with pytest.raises(AdapterPathError, match="adapter_config.json resolves to"):
        read_adapter_dir(str(inside), allowed_dirs=(str(allowed),))
    assert read_adapter_dir(str(outside))[1]  # no rule given: read as before


@pytest.mark.parametrize("swapped", ["file", "directory"])
def test_a_file_swapped_for_a_symlink_after_its_check_is_not_read(adapter, tmp_path, monkeypatch, swapped):
    """Check, then open by path: a weights file (or the adapter's directory) replaced by a symlink out of the
    allowed directory between the check and the open is refused, never read (it is opened once, O_NOFOLLOW,
    and where the opened file really is is checked)."""
    from loramux.adapters import files

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    inside = allowed / "pirate"
    shutil.copytree(adapter, inside)
    shutil.copytree(adapter, outside)
    real_resolve = files._resolve

    def resolve_then_swap(file, allowed_dirs):
        real = real_resolve(file, allowed_dirs)
        if file.endswith("adapter_model.safetensors") and not os.path.islink(inside):
            if swapped == "file":
                os.remove(real)
                os.symlink(outside / "adapter_model.safetensors", real)
            else:
                os.rename(inside, allowed / "moved")
                os.symlink(outside, inside)
        return real

    monkeypatch.setattr(files, "_resolve", resolve_then_swap)
    with pytest.raises(AdapterPathError, match="cannot be opened as the file it was checked|outside the allowed"):
        read_adapter_dir(str(inside), allowed_dirs=(str(allowed),))


def test_a_config_is_read_up_to_a_size_cap_and_a_fifo_is_not_waited_on(adapter, tmp_path):
    big = shutil.copytree(adapter, tmp_path / "big")
    (big / "adapter_config.json").write_text('{"r": 8' + " " * (2 << 20) + "}")
    with pytest.raises(InvalidAdapterError, match="adapter_config.json is 2097160 bytes; a PEFT config takes at most"):
        read_adapter_dir(str(big))
    fifo = shutil.copytree(adapter, tmp_path / "fifo")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.remove(fifo / name)
        os.mkfifo(fifo / name)  # nothing ever writes it: an open that waited would hang here
        with pytest.raises(AdapterPathError, match="is not a regular file"):
            read_adapter_dir(str(fifo))
        os.remove(fifo / name)
        shutil.copy(f"{adapter}/{name}", fifo / name)


def test_a_weights_file_larger_than_any_adapter_for_the_model_is_refused_unread(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    with open(path / "adapter_model.safetensors", "r+b") as f:
        f.truncate(2 << 30)  # a sparse 2 GB file: nothing is allocated, and nothing may be read
    with pytest.raises(InvalidAdapterError, match="at most 1000"):
        read_adapter_dir(str(path), max_weight_bytes=1000)
