"""Many tenants, served: throughput and latency as the number of distinct adapters grows, with adapters
registered up front or loaded on their first request through a resolver, and vLLM-CPU's `vllm serve` on the
same workloads, each driven by vLLM's load generator (`vllm bench serve`) in one run.

Model: the embedded default as an HF checkpoint (SmolLM2-135M-Instruct, --dtype bfloat16), rank-8 PEFT
adapters on all 7 projections (8 distinct weight sets, hard-linked into as many adapter directories as a run
needs: every directory is its own adapter to both servers). Workload: --requests random prompts of
--prompt-len tokens + --new-tokens new ones, --concurrency in flight, each request's adapter drawn at random
among the run's. Runs:
  loramux 8 / 128 / 1000         registered at start (`--lora-modules`); the host tier holds all of them up to
                                 128, --host-loras of the 1000 (the others are read back when asked for)
  loramux 1000, on demand        nothing registered: `--lora-resolver-dir`, a host tier of --host-loras
  loramux 1000, slow store       the example store plugin (examples/store_resolver.py) with a --store-delay-s
                                 copy per adapter (a stand-in for a network store), host tier of --host-loras
  vllm 8 / 1000                  `vllm serve --enable-lora --lora-modules ...` (--max-cpu-loras as many)
  loramux 1000, all in host       registered, a host tier holding all 1000 (the baseline of the slow store)
  loramux base / vllm base       no adapter asked for: loramux with its LoRA slots as above, vLLM with LoRA off
                                 (each engine's ceiling on this machine and workload)
  loramux 64 / 1000, host 16     host pressure: 16 device slots and a host tier of 16 (--max-cpu-loras equal to
                                 --max-loras), 4x / 62x more adapters in flight, each read on its first request
                                 through the slow store. Every request must succeed (the `failed` count), at >= 0.9x
                                 the throughput and <= 1.10x the TPOT p99 of every adapter in host memory:
  loramux 64, host 64, 16 slots  the same store, first reads and 16 slots, with a host tier holding all 64 (what the
                                 host tier's pressure costs: the target's baseline)
  loramux 64 / 1000, all in host, 16 slots
                                 the same adapters registered at start, 16 slots, all in host memory: nothing read
                                 during the run (against it, a ratio also holds the store's first reads)
  loramux 64, registered, host tier 16, 16 slots
                                 the host tier's pressure alone: the 64 adapters registered at start (no store, no
                                 first read during the run), 16 slots and a host tier of 16, against the same
                                 all in host
With --repeats N each run is done N times, the runs in the order given, then in the reverse order, and so on
(ABBA: on a shared 2-core machine the speed drifts by 5-10% within minutes, which otherwise lands on whichever
side ran second), and each number is the mean over a run's repeats.
During the slow-store run, --probes requests for adapters nobody has asked for yet are sent one at a time, each
beside the same request for an adapter read into host memory earlier: a cold adapter's TTFT against its copy +
the TTFT of an adapter already read, under the same load.
Then the registry at scale: --registry adapters (rank 1, q_proj: small files) loaded on demand, one request
each, and `/v1/models`' latency and the HTTP front end's memory before and after.

Then the combined trace (--trace-requests, 0: skipped): sessions of one tenant each, the tenant drawn with Zipf
popularity (exponent --zipf) over 1,000 adapters; a session starts with one of --system-prompts shared system
prompts and is a chat of 1-4 turns resending the conversation; --open-sessions under way at once, interleaved;
Poisson arrivals at each of --trace-rates requests/s (`--dataset-name custom` in arrival order, each request's
adapter given round robin). Reported: goodput, the requests/s whose TTFT <= --slo-ttft-ms and TPOT <=
--slo-tpot-ms, for loramux (adapters on demand from a directory, host tier --host-loras, prefix cache on) and
vLLM-CPU (all 1,000 registered and in host memory, prefix cache on), a fresh server for each rate. Then each
side's SLO capacity on the same trace: the highest Poisson rate at which >= 90% of the requests meet both SLOs,
found by stepping the rate from --capacity-start (doubling while it holds, halving while it does not, down to
--capacity-floor: 0 means not even that rate held; --no-capacity skips it).

  .venv/bin/python benchmarks/multitenant.py [--vllm-venv /tmp/vllm-cpu-venv]     # ~60 min on 2 cores
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import statistics
import threading
import sys
from collections.abc import Callable
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import VLLM_CPU_ENV, bench_serve, check_load_generator, free_port, print_rows, serve, stop  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
RUNS = ("loramux 8", "loramux 128", "loramux 1000", "loramux 1000, on demand", "loramux 1000, slow store",
        "loramux 1000, all in host", "vllm 8", "vllm 1000", "loramux base", "vllm base",
        "loramux 64, host 16", "loramux 64, all in host, 16 slots", "loramux 1000, host 16",
        "loramux 1000, all in host, 16 slots", "loramux 64, registered, host tier 16, 16 slots",
        "loramux 64, host 64, 16 slots")
HOST16_SLOTS = 16
HOST_TIER = re.compile(r"\bhost (\d+)\b")
"""In a run's name, the host tier of a run whose adapters come through the slow store on their first request."""
CAPACITY_SHARE = 0.9  # of the requests that must meet both SLOs at a rate within the capacity
TRACE_SIDES = ("loramux", "vllm")
WORDS = "the a ship sails north over calm grey water while gulls circle and the crew sings of home".split()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=32, help="device slots, on both servers")
    parser.add_argument("--host-loras", type=int, default=64, help="the host tier of the on-demand runs")
    parser.add_argument("--store-delay-s", type=float, default=0.3)
    parser.add_argument("--probes", type=int, default=6, help="cold adapters probed during the slow-store run")
    parser.add_argument("--registry", type=int, default=10_000)
    parser.add_argument("--trace-requests", type=int, default=200)
    parser.add_argument("--trace-rates", type=float, nargs="*", default=[1.0, 2.0, 3.0])
    parser.add_argument("--trace-sides", nargs="+", default=list(TRACE_SIDES), choices=TRACE_SIDES)
    parser.add_argument("--trace-adapters", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=200)
    parser.add_argument("--open-sessions", type=int, default=12)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000)
    parser.add_argument("--slo-tpot-ms", type=float, default=100)
    parser.add_argument("--capacity-start", type=float, nargs=2, default=[2.0, 0.5], metavar=("LORAMUX", "VLLM"),
                        help="the first rate each side's SLO capacity is tried at (requests/s)")
    parser.add_argument("--capacity-steps", type=int, default=5, help="rates tried per side at most")
    parser.add_argument("--capacity-floor", type=float, default=0.25,
                        help="no rate below this is tried (a run lasts --trace-requests / rate seconds)")
    parser.add_argument("--no-capacity", action="store_true")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS)
    parser.add_argument("--repeats", type=int, default=1,
                        help="each run this many times, in the order given, then the reverse, ... (ABBA: a drift in the "
                             "machine's speed cancels out of the ratios); each number the mean of its repeats")
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def adapter_dirs(root: str, weights: list[str], count: int, prefix: str) -> dict[str, str]:
    """`count` adapter directories under root, hard-linking the files of `weights` round robin."""
    found = {}
    for i in range(count):
        source, target = weights[i % len(weights)], os.path.join(root, f"{prefix}{i}")
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(source):
            if not os.path.exists(os.path.join(target, name)):
                os.link(os.path.join(source, name), os.path.join(target, name))
        found[f"{prefix}{i}"] = target
    return found


def adapter_count(run: str) -> int:
    """How many distinct adapters a run serves: "loramux 1000, on demand" -> 1000; "vllm base" -> 0."""
    count = run.split()[1].rstrip(",")
    return 0 if count == "base" else int(count)


def start(run: str, args, model: str, adapters: dict[str, str], root: str):
    port, side, count = free_port(), run.split()[0], adapter_count(run)
    common = ["--port", str(port), "--dtype", args.dtype, "--served-model-name", "base", "--max-num-seqs",
              str(args.concurrency), "--max-model-len", str(args.prompt_len + args.new_tokens + 16)]
    max_loras = HOST16_SLOTS if "host 16" in run or "16 slots" in run else args.max_loras
    slots = ["--max-loras", str(max_loras), "--max-lora-rank", "8"]
    lora = ["--lora-modules", *[f"{n}={p}" for n, p in adapters.items()]] if adapters else []
    if side == "vllm":
        env = {**os.environ, **VLLM_CPU_ENV}
        cmd = [os.path.join(args.vllm_venv, "bin", "vllm"), "serve", model, *common]
        if adapters:  # "vllm base": the base model alone, LoRA off (the peer's ceiling on this machine)
            cmd += [*slots, "--enable-lora", "--max-cpu-loras", str(max(count, args.max_loras)), *lora]
        return serve(cmd, port, timeout_s=1200, env=env)
    # "loramux base": LoRA on (its slots allocated) and no adapter asked for, as a many-tenant server runs
    cmd = [sys.executable, "-m", "loramux", "serve", "--model", model, *common, *slots, "--log-level", "warning"]
    env = None
    if "on demand" in run:
        cmd += ["--lora-resolver-dir", root, "--max-cpu-loras", str(max(args.host_loras, args.max_loras))]
    elif "slow store" in run or HOST_TIER.search(run):
        path = os.pathsep.join(filter(None, [EXAMPLES, os.environ.get("PYTHONPATH")]))  # (the caller's loramux too)
        env = {**os.environ, "PYTHONPATH": path, "ADAPTER_STORE": root, "ADAPTER_STORE_DELAY_S": str(args.store_delay_s),
               "ADAPTER_CACHE": tempfile.mkdtemp(prefix="cache-", dir=os.path.dirname(root))}  # cold at every start
        tier = HOST_TIER.search(run)
        host = int(tier.group(1)) if tier else max(args.host_loras, args.max_loras)
        cmd += ["--lora-resolver", "store_resolver:StoreResolver", "--max-cpu-loras", str(host)]
    else:
        host = count if count <= 128 or "all in host" in run else args.host_loras
        host = HOST16_SLOTS if "host tier 16" in run else host
        cmd += ["--max-cpu-loras", str(max(host, max_loras)), *lora]
    return serve(cmd, port, timeout_s=1200, env=env)


def run_one(run: str, args, model: str, adapters: dict[str, str], root: str, workdir: str) -> dict:
    proc, url = start(run, args, model, adapters, root)
    try:
        bench = argparse.Namespace(vllm_venv=args.vllm_venv, quiet=args.quiet, prompt_len=args.prompt_len,
                                   new_tokens=args.new_tokens)
        bench_serve(bench, url, model, list(adapters)[:8], workdir, f"{run}-warmup", ["--num-prompts", "8"])
        probe = _Probe(url, [f"t{len(adapters) + i}" for i in range(2 * args.probes)], args) if "slow store" in run else None
        found = bench_serve(bench, url, model, list(adapters), workdir, run,
                            ["--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency)])
        return found if probe is None else {**found, "cold_probe": probe.result()}
    finally:
        stop(proc)


class _Probe(threading.Thread):
    """While a run goes on, one at a time: a request for each of `cold` (adapters nobody has asked for), each after
    a request for the matching `warm` adapter, read into host memory when the run began: both wait for a free
    device slot and a place in the batch, only the cold one for its copy and read."""

    def __init__(self, url: str, names: list[str], args):
        super().__init__(daemon=True)
        self.url, self.args, self.found = url, args, {"cold_ttft_ms": [], "warm_ttft_ms": []}
        self.cold, self.warm = names[:len(names) // 2], names[len(names) // 2:]
        self.start()

    def run(self) -> None:
        for name in self.warm:
            _ttft(self.url, name, "hello")
        time.sleep(10)  # into the run: the batch is full and other tenants' adapters are arriving
        rng = random.Random(1)
        for cold, warm in zip(self.cold, self.warm):
            for model, key in ((warm, "warm_ttft_ms"), (cold, "cold_ttft_ms")):
                prompt = " ".join(rng.choice(WORDS) for _ in range(self.args.prompt_len * 3 // 4))
                self.found[key].append(_ttft(self.url, model, prompt))

    def result(self) -> dict:
        self.join()
        cold, warm = statistics.median(self.found["cold_ttft_ms"]), statistics.median(self.found["warm_ttft_ms"])
        return {**self.found, "store_delay_ms": 1000 * self.args.store_delay_s,
                "cold_over_copy_and_warm_ms": cold - warm - 1000 * self.args.store_delay_s}


def _ttft(url: str, model: str, prompt: str) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return 1000 * (time.perf_counter() - started)
    raise RuntimeError(f"no token streamed for {model}")


def trace_dataset(path: str, args, names: list[str]) -> list[str]:
    """The combined trace as a custom dataset, rows in arrival order; returns each row's adapter."""
    rng = random.Random(0)
    systems = [f"You are assistant {i}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for i in range(args.system_prompts)]
    weights = [1 / rank**args.zipf for rank in range(1, len(names) + 1)]

    def session() -> dict:
        return {"adapter": rng.choices(names, weights)[0], "turns": rng.choice((1, 1, 2, 3, 4)),
                "lines": [f"System: {rng.choice(systems)}"]}

    sessions, rows, adapters = [session() for _ in range(args.open_sessions)], [], []
    while len(rows) < args.trace_requests:
        i = rng.randrange(len(sessions))
        lines = sessions[i]["lines"]
        lines.append("User: " + " ".join(rng.choice(WORDS) for _ in range(24)))
        rows.append({"prompt": "\n".join(lines) + "\nAssistant:", "output_tokens": args.new_tokens})
        adapters.append(sessions[i]["adapter"])
        lines.append("Assistant: " + " ".join(rng.choice(WORDS) for _ in range(args.new_tokens)))
        sessions[i]["turns"] -= 1
        if sessions[i]["turns"] == 0:
            sessions[i] = session()
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return adapters


def trace(args, model: str, root: str, adapters: dict[str, str], workdir: str) -> dict:
    """The combined trace on each of --trace-sides at each of --trace-rates: side -> rate -> bench_serve's result."""
    assigned = trace_dataset(os.path.join(workdir, "trace.jsonl"), args, list(adapters))
    found = {}
    for side in args.trace_sides:
        for rate in args.trace_rates:
            found.setdefault(side, {})[str(rate)] = _trace_run(args, side, rate, model, root, adapters, assigned, workdir)
    return found


def capacity(args, model: str, root: str, adapters: dict[str, str], workdir: str) -> dict:
    """Each side's SLO capacity on the combined trace: the highest Poisson rate at which CAPACITY_SHARE of the
    requests meet both SLOs, the rate doubled while they do and halved while they do not, until a rate that holds
    and twice it that does not are found (or --capacity-steps are spent). side -> {capacity, share at each rate}."""
    assigned = trace_dataset(os.path.join(workdir, "trace.jsonl"), args, list(adapters))
    found = {}
    for side, rate in zip(TRACE_SIDES, args.capacity_start):
        if side not in args.trace_sides:
            continue
        shares: dict[float, float] = {}
        for _ in range(args.capacity_steps):
            result = _trace_run(args, side, rate, model, root, adapters, assigned, workdir)
            shares[rate] = (result["request_goodput"] or 0) * result["duration_s"] / len(assigned)
            rate = rate * 2 if shares[rate] >= CAPACITY_SHARE else rate / 2
            if rate in shares or rate < args.capacity_floor:
                break
        held = [r for r, share in shares.items() if share >= CAPACITY_SHARE]
        found[side] = {"capacity": max(held, default=0.0), "share_meeting_slo": {str(r): v for r, v in shares.items()}}
    return found


def _trace_run(args, side: str, rate: float, model: str, root: str, adapters: dict[str, str], assigned: list[str],
               workdir: str) -> dict:
    """The combined trace at `rate` on a fresh server of `side`: bench_serve's result."""
    dataset = ["--dataset-name", "custom", "--dataset-path", os.path.join(workdir, "trace.jsonl"),
               "--custom-output-len", str(args.new_tokens), "--skip-chat-template", "--disable-shuffle"]
    bench = argparse.Namespace(vllm_venv=args.vllm_venv, quiet=args.quiet, prompt_len=64, new_tokens=8)
    proc, url = _start_trace_side(side, args, model, adapters, root)
    try:
        bench_serve(bench, url, model, ["base"], workdir, f"trace-{side}-warmup", ["--num-prompts", "8"])
        return bench_serve(bench, url, model, assigned, workdir, f"trace-{side}-{rate}",
                           ["--num-prompts", str(len(assigned)), "--request-rate", str(rate), "--lora-assignment",
                            "round-robin", "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}"], dataset)
    finally:
        stop(proc)


def _start_trace_side(side: str, args, model: str, adapters: dict[str, str], root: str):
    port = free_port()
    common = ["--port", str(port), "--dtype", args.dtype, "--served-model-name", "base", "--max-loras",
              str(args.max_loras), "--max-lora-rank", "8", "--max-num-seqs", str(args.concurrency), "--max-model-len",
              "2048", "--enable-prefix-caching"]
    if side == "vllm":
        cmd = [os.path.join(args.vllm_venv, "bin", "vllm"), "serve", model, *common, "--enable-lora", "--max-cpu-loras",
               str(len(adapters)), "--lora-modules", *[f"{n}={p}" for n, p in adapters.items()]]
        return serve(cmd, port, timeout_s=1200, env={**os.environ, **VLLM_CPU_ENV})
    return serve([sys.executable, "-m", "loramux", "serve", "--model", model, *common, "--log-level", "warning",
                  "--lora-resolver-dir", root, "--max-cpu-loras", str(max(args.host_loras, args.max_loras))], port)


def registry(args, model: str, root: str, weights: str) -> dict:
    """--registry adapters loaded on demand (one request each): /v1/models' latency and the front end's memory."""
    names = adapter_dirs(root, [weights], args.registry, "r")
    port = free_port()
    proc, url = serve([sys.executable, "-m", "loramux", "serve", "--model", model, "--port", str(port), "--dtype",
                       args.dtype, "--max-lora-rank", "8", "--lora-resolver-dir", root, "--log-level", "warning"], port)
    try:
        found = {"adapters": args.registry, "before": _registry_state(url, proc.pid)}
        body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
        started = time.monotonic()
        with httpx.Client(base_url=url, timeout=600) as http, concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda n: http.post("/v1/completions", json={**body, "model": n}).status_code, names))
        found["load_s"] = time.monotonic() - started
        found["ok"] = codes.count(200)
        found["after"] = _registry_state(url, proc.pid)
        return found
    finally:
        stop(proc)


def _registry_state(url: str, server_pid: int) -> dict:
    with httpx.Client(base_url=url, timeout=60) as http:
        times, count = [], 0
        for _ in range(20):
            started = time.perf_counter()
            count = len(http.get("/v1/models").json()["data"])
            times.append(time.perf_counter() - started)
    return {"models": count, "v1_models_p50_ms": 1000 * statistics.median(times),
            "frontend_rss_mb": _rss_mb(_child(server_pid, "loramux-http"))}


def _child(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for child in f.read().split():
            with open(f"/proc/{child}/comm") as c:
                if c.read().strip() == name:
                    return int(child)
    raise LookupError(name)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def main(argv=None) -> None:
    args = parse_args(argv)
    check_load_generator(args)
    from transformers import AutoConfig

    from loramux.models.loader import default_model_path

    model = default_model_path()
    workdir = scratch_dir("loramux-multitenant-")
    hf_config = AutoConfig.from_pretrained(model)
    weights = [write_adapter(os.path.join(workdir, "weights", f"w{i}"), hf_config, 8, seed=i) for i in range(8)]
    report = {"model": os.path.basename(model), "dtype": args.dtype, "requests": args.requests,
              "max_loras": args.max_loras, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "concurrency": args.concurrency,
              "host_loras": args.host_loras, "store_delay_s": args.store_delay_s, "load_before": cpu_load(), "runs": {}}
    def one(run: str) -> dict:
        count = adapter_count(run)
        root = os.path.join(workdir, run.replace(" ", "_").replace(",", ""))
        adapters = adapter_dirs(root, weights, count + 2 * args.probes, "t")
        adapters = dict(list(adapters.items())[:count])  # the probes' adapters exist, asked for by the probe alone
        return run_one(run, args, model, adapters, root, workdir)

    report["runs"] = repeated(args.runs, args.repeats, one)
    if args.trace_requests:
        root = os.path.join(workdir, "trace")
        adapters = adapter_dirs(root, weights, args.trace_adapters, "t")
        if args.trace_rates:
            report["trace"] = trace(args, model, root, adapters, workdir)
        if not args.no_capacity:
            report["capacity"] = capacity(args, model, root, adapters, workdir)
    if args.registry:
        small = write_adapter(os.path.join(workdir, "weights", "small"), hf_config, 1, seed=99, projections=("q_proj",))
        report["registry"] = registry(args, model, os.path.join(workdir, "registry"), small)
    report["load_after"] = cpu_load()
    report["ratios"] = ratios(report)
    print_report(report)


def repeated(runs: list[str], repeats: int, one: Callable[[str], dict]) -> dict[str, dict]:
    """one(run) for each run, `repeats` times: in the order given, then the reverse, ... (ABBA: a drift in the
    machine's speed cancels out of the ratios); each run's results as one (_mean)."""
    found: dict[str, list[dict]] = {}
    for repeat in range(repeats):
        for run in runs if repeat % 2 == 0 else runs[::-1]:
            found.setdefault(run, []).append(one(run))
    return {run: _mean(results) for run, results in found.items()}


def _mean(results: list[dict]) -> dict:
    """One run's repeats as one: each number their mean (a percentile too: the mean of each repeat's), and each
    repeat's own numbers under "repeats"."""
    if len(results) == 1:
        return results[0]
    numbers = [k for k, v in results[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {**results[0], **{k: statistics.fmean(r[k] for r in results) for k in numbers}, "repeats": results}


def ratios(report: dict) -> dict:
    runs, found = report["runs"], {}
    tput = {run: r["output_throughput"] for run, r in runs.items()}
    pairs = [("loramux 64, host 16", "loramux 64, all in host, 16 slots"),
             ("loramux 64, host 16", "loramux 64, host 64, 16 slots"),
             ("loramux 64, registered, host tier 16, 16 slots", "loramux 64, all in host, 16 slots"),
             ("loramux 1000, host 16", "loramux 1000, all in host, 16 slots"),
             ("loramux 1000", "loramux 8"), ("loramux 1000, on demand", "loramux 1000, all in host"),
             ("loramux 1000, slow store", "loramux 1000, all in host"), ("loramux 8", "vllm 8"),
             ("loramux 1000", "vllm 1000"), ("loramux 1000, slow store", "vllm 1000"), ("loramux base", "vllm base"),
             ("vllm 8", "vllm base"), ("loramux 8", "loramux base"), ("loramux 8", "vllm base")]
    for a, b in pairs:
        if a in tput and b in tput:
            found[f"{a} / {b}: throughput"] = tput[a] / tput[b]
    for a, b in (("loramux 1000, on demand", "loramux 1000, all in host"),
                 ("loramux 1000, slow store", "loramux 1000, all in host"),
                 ("loramux 64, host 16", "loramux 64, all in host, 16 slots"),
                 ("loramux 64, host 16", "loramux 64, host 64, 16 slots"),
                 ("loramux 64, registered, host tier 16, 16 slots", "loramux 64, all in host, 16 slots"),
                 ("loramux 1000, host 16", "loramux 1000, all in host, 16 slots")):
        if a in runs and b in runs:
            found[f"{a} / {b}: TPOT p99"] = runs[a]["p99_tpot_ms"] / runs[b]["p99_tpot_ms"]
    capacity = report.get("capacity", {})
    if capacity.get("vllm", {}).get("capacity") and "loramux" in capacity:
        found["SLO capacity loramux / vllm"] = capacity["loramux"]["capacity"] / capacity["vllm"]["capacity"]
    sides = report.get("trace", {})
    for rate in sides.get("loramux", {}):
        if rate in sides.get("vllm", {}):
            ours, theirs = sides["loramux"][rate]["request_goodput"], sides["vllm"][rate]["request_goodput"]
            found[f"trace at {rate} req/s: goodput loramux / vllm"] = ours / theirs if theirs else float("inf")
    return found


def print_report(report: dict) -> None:
    print_rows(report["runs"], report["ratios"])
    probe = next((r["cold_probe"] for r in report["runs"].values() if "cold_probe" in r), None)
    if probe:
        print(f"cold adapters during the slow-store run: TTFT p50 {statistics.median(probe['cold_ttft_ms']):.0f} ms "
              f"(copy {probe['store_delay_ms']:.0f} ms + an adapter in host memory's TTFT "
              f"{statistics.median(probe['warm_ttft_ms']):.0f} ms + {probe['cold_over_copy_and_warm_ms']:.0f} ms)")
    if "registry" in report:
        r = report["registry"]
        print(f"registry: {r['ok']}/{r['adapters']} loaded on demand in {r['load_s']:.0f} s; /v1/models "
              f"{r['before']['v1_models_p50_ms']:.1f} -> {r['after']['v1_models_p50_ms']:.1f} ms, front end "
              f"{r['before']['frontend_rss_mb']:.0f} -> {r['after']['frontend_rss_mb']:.0f} MB")
    for side, found in report.get("capacity", {}).items():
        shares = ", ".join(f"{float(r):g}/s: {100 * v:.0f}%" for r, v in found["share_meeting_slo"].items())
        print(f"SLO capacity, {side}: {found['capacity']:g} requests/s (requests meeting both SLOs: {shares})")
    for side, rates in report.get("trace", {}).items():
        for rate, r in rates.items():
            print(f"trace, {side} at {rate} req/s: goodput {r['request_goodput']:.2f} of {r['request_throughput']:.2f} "
                  f"req/s, {r['output_throughput']:.0f} tok/s, TTFT p99 {r['p99_ttft_ms']:.0f} ms, "
                  f"TPOT p99 {r['p99_tpot_ms']:.0f} ms")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
