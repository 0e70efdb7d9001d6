"""lm-evaluation-harness against `loramux serve` with an adapter as `model` (its `local-completions` model:
loglikelihood through echo + logprobs, generate_until through completions) gives the same per-sample results
as `lm_eval --model hf` with that PEFT adapter on the same fp32 weights. Tasks: tests/lm_eval/*.yaml, from
local JSON Lines files (nothing downloaded)."""
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.serving import make_files, start_server, stop

pytestmark = pytest.mark.slow
TASKS = Path(__file__).resolve().parents[1] / "lm_eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def tasks_dir(tmp_path) -> str:
    """The repo's task files with their data paths made absolute."""
    out = tmp_path / "tasks"
    out.mkdir()
    for yaml in TASKS.glob("*.yaml"):
        (out / yaml.name).write_text(yaml.read_text().replace("DATA_DIR", str(TASKS)))
    return str(out)


def lm_eval(model: str, model_args: str, include: str, out: Path) -> dict[str, dict[int, dict]]:
    """{task: {doc_id: sample}} from one lm_eval run with --log_samples."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks",
           "loramux_mc,loramux_gen", "--include_path", include, "--batch_size", "1", "--log_samples",
           "--output_path", str(out), "--seed", "0", "--device", "cpu"]
    done = subprocess.run(cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    samples = {}
    for task in ("loramux_mc", "loramux_gen"):
        (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        samples[task] = {s["doc_id"]: s for s in map(json.loads, Path(path).read_text().splitlines())}
    return samples


def test_lm_eval_through_the_server_equals_hf_peft(tmp_path_factory, tmp_path):
    # vocab_size = the character tokenizer's length: lm_eval's hf model resizes the embeddings of a model with
    # a PEFT adapter to the tokenizer's length (for adapters that add tokens), which would change its softmax
    files = make_files(tmp_path_factory, vocab_size=98)
    include = tasks_dir(tmp_path)
    proc, url = start_server(files, "--max-model-len", "256")
    try:
        served = lm_eval("local-completions", f"model=s1,base_url={url}/v1/completions,tokenizer={files['model']},"
                         "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
                         include, tmp_path / "served")
    finally:
        stop(proc)
    hf = lm_eval("hf", f"pretrained={files['model']},peft={files['served']['s1']},dtype=float32",
                 include, tmp_path / "hf")
    mc, gen = served["loramux_mc"], hf["loramux_mc"]
    assert mc.keys() == gen.keys() and len(mc) == 6
    for doc_id, sample in mc.items():
        ours, theirs = sample["filtered_resps"], gen[doc_id]["filtered_resps"]
        assert [g for _, g in ours] == [g for _, g in theirs], doc_id  # is_greedy per choice
        assert all(abs(float(a) - float(b)) < 1e-3 for (a, _), (b, _) in zip(ours, theirs)), (doc_id, ours, theirs)
        assert sample["acc"] == gen[doc_id]["acc"]
    for doc_id, sample in served["loramux_gen"].items():
        assert sample["filtered_resps"] == hf["loramux_gen"][doc_id]["filtered_resps"], doc_id
    assert any(s["filtered_resps"][0] for s in served["loramux_gen"].values())  # something was generated
