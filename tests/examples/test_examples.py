"""The example scripts run as users run them (a subprocess each): the step loop on the embedded default with the
demo adapters, and LoRA over quantized bases, on the default's bases and on tiny GPTQ, AWQ and bitsandbytes
checkpoints built here."""
import os
import subprocess
import sys

import pytest

from conftest import save_peft_adapter, tiny_llama

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def run_example(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_multilora_step_loop_finishes_every_request_with_its_adapter():
    out = run_example("multilora_inference.py")
    finished = [line.split() for line in out.splitlines() if line.startswith("step")]
    assert sorted(f[2] for f in finished) == sorted(["base", "pirate", "pirate", "french", "json", "french"])
    assert all(f[3] in ("length", "stop") for f in finished)
    assert "first token's logprob" in out


def test_lora_over_the_defaults_quantized_bases():
    out = run_example("lora_with_quantization_inference.py")
    for label, fmt in (("gguf-q4_1", "q4_1"), ("bitsandbytes", "nf4g64"), ("int4", "i4g32")):
        assert f"== {label}: " in out and fmt in out.split(f"== {label}: ")[1].splitlines()[0]
    assert out.count("  pirate ") == 3 and out.count("  base ") == 3


def test_lora_over_pre_quantized_gptq_awq_and_bitsandbytes_checkpoints(tmp_path):
    from models.test_quantized import bnb_checkpoint, quantized_checkpoint

    gptq, _ = quantized_checkpoint(tmp_path / "gptq", "gptq", 32)
    awq, _ = quantized_checkpoint(tmp_path / "awq", "awq", 32)
    pytest.importorskip("bitsandbytes")
    bnb = bnb_checkpoint(tmp_path / "bnb", "nf4", True)
    adapter = save_peft_adapter(tiny_llama(), tmp_path / "adapter", seed=1, r=8, target_modules=["q_proj", "v_proj"])
    out = run_example("lora_with_quantization_inference.py", "--model", f"gptq={gptq}", "--model", f"awq={awq}",
                      "--model", f"bnb={bnb}", "--adapter", adapter, "--dtype", "float32")
    assert "== gptq: " in out and "== awq: " in out and "== bnb: nf4g64" in out
    assert out.count("  adapter0 ") == 3


def test_dora_alora_and_a_weighted_pair_beside_lora_and_base_rows_equal_peft_alone():
    out = run_example("adapter_kinds.py")
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:5]] == ["dora", "intrinsic", "pair", "pirate", "base"]
    assert "(cached prompt tokens: 0)" not in lines[1]  # the intrinsic read the base model's turn from the cache
    assert lines[-3:] == [f"{kind} row equals HF + PEFT alone: True" for kind in ("dora", "intrinsic", "pair")]
