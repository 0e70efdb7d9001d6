"""Weight sync for reinforcement learning: a trainer process pushes a new revision of a rank-16 adapter on all 7
projections every --interval-s while --streams clients generate with it without pause; side by side in one run:

  loramux, push        the trainer uploads the weights in the request (multipart /v1/load_lora_adapter,
                       load_inplace): loramux's way
  loramux, files       the trainer writes safetensors under --allowed-adapter-dir, then a JSON load_inplace:
                       vLLM's way, on loramux
  vllm, files          the same against vLLM-CPU's `vllm serve` (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
  loramux / vllm, no pushes   the streams alone: each side's throughput and TPOT without pushes

Push-to-served: from the trainer's call (before it writes or sends anything) to the first token of a one-token
request it sends as soon as the load answers (as a rollout loop starts its next rollouts): p50 / p99. loramux's
answers name their revision (system_fingerprint), so for its runs the probe must name the pushed one, and every
stream's sample is checked afterwards against an offline run (LLM.load_adapter_from_tensors) with the revision
it names: "matched" counts samples equal to it; "mixed" those closer to another revision's text (a longer
common prefix: must be 0); "diverged" those closest to their own but not equal (bf16: a near-tie argmax that
flips with the batch's shape; none in float32).

The trainer stands in for one on another host: it makes all its revisions' weights before the streams start and
serializes each push on one thread, so that only the push itself (serializing, sending or writing, and the
server's work) shares the cores with the streams.

Model: the embedded default as an HF checkpoint (SmolLM2-135M-Instruct), --dtype float32 on both servers (in
bfloat16 random adapters leave many near-tie tokens, and a sample that flips one cannot be checked).
Targets: push-to-served p99 <= 100 ms; throughput with pushes >= 0.9x without; >= 5x faster push-to-served than
vLLM-CPU's way.

  .venv/bin/python benchmarks/rl_sync.py [--vllm-venv /tmp/vllm-cpu-venv]     # ~10 min on 2 cores
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time

import httpx
import torch
from safetensors.torch import load, save, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import VLLM_CPU_ENV, free_port, serve, stop  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

RUNS = ("loramux, push", "loramux, files", "loramux, no pushes", "vllm, files", "vllm, no pushes")
NAME = "policy"
PROMPTS = ["Write a short poem about the sea.", "Explain photosynthesis simply.", "List three uses of a brick.",
           "What is a prime number?", "Describe a sunrise in one paragraph.", "Give advice to a new programmer."]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", help="float32: the sample check needs outputs that do not "
                        "flip with the batch's shape (bf16 near-ties do; see the docstring)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pushes", type=int, default=12)
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS)
    parser.add_argument("--gguf", action="store_true", help="serve the embedded default as it ships (its Q4_1 GGUF, "
                        "fp32 activations) instead of its HF checkpoint; loramux runs only (vLLM-CPU needs the HF one)")
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv")
    return parser.parse_args(argv)


# ---- the trainer (a process of its own) -----------------------------------------------------------------
def trainer(url: str, way: str, template: dict, config: bytes, workdir: str, pushes: int, interval_s: float,
            results, go) -> None:
    """Makes every push's weights first (seeded by the push's number: each revision answers apart; what a trainer
    computes on its own hardware, so not while the streams run here), puts "ready" on `results` and waits for
    `go`. Then every interval_s: one push `way` and one probe request; one record per push on `results`, then
    None. One thread: serializing a push must not take both cores from the engine, as a trainer on another host
    would not."""
    torch.set_num_threads(1)
    weights = []
    for i in range(pushes):
        gen = torch.Generator().manual_seed(1000 + i)
        weights.append({key: torch.randn(t.shape, generator=gen) * t.std() for key, t in template.items()})
    client = httpx.Client(base_url=url, timeout=300)
    results.put("ready")
    go.wait()
    for i, tensors in enumerate(weights):
        due = time.monotonic() + interval_s
        started = time.monotonic()
        revision, data = push(client, way, tensors, config, os.path.join(workdir, f"push{i}"))
        probe = first_token(client, {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0})
        results.put({"push": i, "seconds": probe["first_token"] - started, "load_s": probe["sent"] - started,
                     "revision": revision, "probe_revision": probe["revision"],
                     "weights": data})  # (bytes: for the check of the samples)
        time.sleep(max(0.0, due - time.monotonic()))
    results.put(None)


def push(client: httpx.Client, way: str, tensors: dict, config: bytes, path: str) -> tuple[str | None, bytes | None]:
    """One push: the revision the server names (None if it names none), and the safetensors bytes sent (None
    when they went to files)."""
    if way == "push":
        data = save(tensors)
        files = {"adapter_config.json": ("adapter_config.json", config),
                 "adapter_model.safetensors": ("adapter_model.safetensors", io.BytesIO(data))}
        r = client.post("/v1/load_lora_adapter", data={"lora_name": NAME, "load_inplace": "true"}, files=files)
    else:
        data = None
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "wb") as f:
            f.write(config)
        r = client.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": path, "load_inplace": True})
    r.raise_for_status()
    return r.headers.get("x-adapter-revision"), data


def first_token(client: httpx.Client, body: dict) -> dict:
    sent = time.monotonic()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return {"sent": sent, "first_token": time.monotonic(),
                        "revision": json.loads(line[6:]).get("system_fingerprint")}
    raise RuntimeError("the probe got no token")


# ---- the streams --------------------------------------------------------------------------------------
def stream_loop(url: str, new_tokens: int, index: int, stop_at: threading.Event, samples: list) -> None:
    """Requests one after another until stop_at is set: each one's prompt, text, revision and timings."""
    with httpx.Client(base_url=url, timeout=300) as client:
        n = index
        while not stop_at.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += 1
            body = {"model": NAME, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            started, times, text, revision = time.monotonic(), [], [], None
            with client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        times.append(time.monotonic())
                        text.append(event["choices"][0]["text"])
                        revision = revision or event.get("system_fingerprint")
            samples.append({"prompt": prompt, "text": "".join(text), "revision": revision, "started": started,
                            "times": times})


def run_one(run: str, args, model: str, template: dict, config: bytes, workdir: str) -> dict:
    side, way = run.split(", ")
    proc, url = start(side, args, model, workdir)
    try:
        first_token(httpx.Client(base_url=url, timeout=300), {"model": NAME, "prompt": "hi", "max_tokens": 4})
        pushes = Pushes(url, way, args, template, config, workdir)
        stop_at, samples = threading.Event(), []
        streams = [threading.Thread(target=stream_loop, args=(url, args.new_tokens, i, stop_at, samples))
                   for i in range(args.streams)]
        for t in streams:
            t.start()
        done = pushes.run()
        stop_at.set()
        for t in streams:
            t.join()
    finally:
        stop(proc)
    return {"pushes": done, "samples": samples, **stream_stats(samples)}


class Pushes:
    """The trainer's pushes (a process of its own, started and with its weights made before the streams start),
    or, with no pushes, the same span of time idle."""

    def __init__(self, url, way, args, template, config, workdir):
        self.args, self.proc = args, None
        if way == "no pushes":
            return
        spawn = multiprocessing.get_context("spawn")
        self.results, self.go = spawn.Queue(), spawn.Event()
        self.proc = spawn.Process(target=trainer, args=(url, way, template, config, workdir, args.pushes,
                                                        args.interval_s, self.results, self.go), daemon=True)
        self.proc.start()
        if self.results.get(timeout=600) != "ready":
            raise RuntimeError("the trainer did not get ready")

    def run(self) -> list[dict]:
        if self.proc is None:
            time.sleep(self.args.pushes * self.args.interval_s)
            return []
        self.go.set()
        done = list(iter(self.results.get, None))
        self.proc.join()
        return done


def start(side: str, args, model: str, workdir: str):
    port = free_port()
    initial = os.path.join(workdir, "initial")
    common = ["--port", str(port), "--dtype", args.dtype, "--served-model-name", "base", "--max-loras", "4",
              "--max-lora-rank", str(args.rank), "--max-num-seqs", str(args.streams + 4), "--max-model-len", "256",
              "--lora-modules", f"{NAME}={initial}"]
    if side == "vllm":
        env = {**os.environ, **VLLM_CPU_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        return serve([os.path.join(args.vllm_venv, "bin", "vllm"), "serve", model, *common, "--enable-lora"], port,
                     timeout_s=1200, env=env)
    return serve([sys.executable, "-m", "loramux", "serve", "--model", model, *common, "--log-level", "warning",
                  "--allowed-adapter-dir", workdir, "--max-adapter-upload-bytes", str(1 << 28),
                  "--lora-keep-revisions", "4"], port)


def stream_stats(samples: list[dict]) -> dict:
    done = [s for s in samples if len(s["times"]) > 1]
    span = max(s["times"][-1] for s in done) - min(s["started"] for s in done)
    tpot = sorted((s["times"][-1] - s["times"][0]) / (len(s["times"]) - 1) for s in done)
    return {"samples_done": len(done), "output_throughput": sum(len(s["times"]) for s in done) / span,
            "p99_tpot_ms": 1000 * tpot[int(0.99 * (len(tpot) - 1))]}


# ---- the check: every sample against its revision, offline -----------------------------------------------
def check_samples(result: dict, model: str, args, config: dict) -> dict:
    """mixed / diverged / matched counts of the run's samples against offline runs of their revisions."""
    from loramux import LLM, LoRAConfig, SamplingParams

    pushed = {p["revision"]: load(p["weights"]) for p in result["pushes"] if p["revision"]}
    samples = [s for s in result["samples"] if s["revision"] in pushed]
    llm = LLM(model=model, lora=LoRAConfig(max_loras=4, max_lora_rank=args.rank, keep_revisions=1), dtype=args.dtype,
              max_num_seqs=len(PROMPTS), max_model_len=256)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    texts = {}  # (revision, prompt) -> text
    for revision, tensors in pushed.items():
        assert llm.load_adapter_from_tensors(NAME, tensors, config, replace=True)
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, adapters=NAME, use_tqdm=False)):
            texts[revision, prompt] = out.text
    counts = {"matched": 0, "mixed": 0, "diverged": 0, "unchecked": len(result["samples"]) - len(samples)}
    for s in samples:
        own = _common(texts[s["revision"], s["prompt"]], s["text"])
        other = max(_common(texts[r, s["prompt"]], s["text"]) for r in pushed if r != s["revision"]) if len(pushed) > 1 else -1
        counts["matched" if own == len(s["text"]) == len(texts[s["revision"], s["prompt"]]) else
               "mixed" if other > own else "diverged"] += 1
    return counts


def _common(a: str, b: str) -> int:
    """The length of a and b's common prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summary(result: dict) -> dict:
    seconds = sorted(p["seconds"] for p in result["pushes"])
    out = {k: result[k] for k in ("samples_done", "output_throughput", "p99_tpot_ms")}
    if seconds:
        out.update(push_p50_ms=1000 * statistics.median(seconds), push_p99_ms=1000 * seconds[int(0.99 * (len(seconds) - 1))],
                   load_p50_ms=1000 * statistics.median(p["load_s"] for p in result["pushes"]),
                   probe_on_new_revision=sum(p["revision"] is None or p["probe_revision"] == p["revision"]
                                             for p in result["pushes"]), pushes=len(seconds))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoConfig

    from loramux.models.loader import default_gguf_path, default_model_path

    hf_model, workdir = default_model_path(), scratch_dir("loramux-rl-sync-")
    model = default_gguf_path() if args.gguf else hf_model
    if args.gguf and any(run.startswith("vllm") for run in args.runs):
        sys.exit("--gguf: loramux runs only (--runs 'loramux, push' ...)")
    initial = write_adapter(os.path.join(workdir, "initial"), AutoConfig.from_pretrained(hf_model), args.rank, seed=0)
    from safetensors.torch import load_file

    template = load_file(os.path.join(initial, "adapter_model.safetensors"))
    with open(os.path.join(initial, "adapter_config.json"), "rb") as f:
        config = f.read()
    report = {"model": os.path.basename(model), "dtype": args.dtype, "streams": args.streams, "pushes": args.pushes,
              "interval_s": args.interval_s, "rank": args.rank, "load_before": cpu_load(), "runs": {}}
    for run in args.runs:
        result = run_one(run, args, model, template, config, workdir)
        report["runs"][run] = summary(result)
        if run == "loramux, push":
            report["runs"][run]["check"] = check_samples(result, model, args, json.loads(config))
        print(run, json.dumps(report["runs"][run]), flush=True)
    report["load_after"] = cpu_load()
    report["ratios"] = ratios(report["runs"])
    print_report(report)


def ratios(runs: dict) -> dict:
    found = {}
    for side in ("loramux", "vllm"):
        base = runs.get(f"{side}, no pushes")
        for way in ("push", "files"):
            run = runs.get(f"{side}, {way}")
            if base and run:
                found[f"{side} {way} throughput / no pushes"] = run["output_throughput"] / base["output_throughput"]
                found[f"{side} {way} TPOT p99 / no pushes"] = run["p99_tpot_ms"] / base["p99_tpot_ms"]
    ours, theirs = runs.get("loramux, push"), runs.get("vllm, files")
    if ours and theirs:
        found["vllm files push-to-served p99 / loramux push"] = theirs["push_p99_ms"] / ours["push_p99_ms"]
    return found


def print_report(report: dict) -> None:
    print(f"\n{'run':<22}{'out tok/s':>10}{'TPOT p99':>10}{'push p50':>10}{'push p99':>10}")
    for run, r in report["runs"].items():
        print(f"{run:<22}{r['output_throughput']:>10.1f}{r['p99_tpot_ms']:>10.1f}"
              f"{r.get('push_p50_ms', float('nan')):>10.1f}{r.get('push_p99_ms', float('nan')):>10.1f}")
    for name, value in report["ratios"].items():
        print(f"  {name}: {value:.2f}x")
    print(json.dumps({"benchmark": "rl_sync", **report}))


if __name__ == "__main__":
    main()
