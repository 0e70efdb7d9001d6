"""benchmarks/throughput.py end to end on a tiny checkpoint: every row, peers, best and median runs, one JSON line."""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_checkpoint, tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"


def load_script(stem: str = "throughput"):
    spec = importlib.util.spec_from_file_location(stem, SCRIPT.parent / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_reports_best_and_median_of_repeats_and_ratios(tmp_path, capsys):
    model = save_checkpoint(tiny_llama(), tmp_path / "model")
    load_script().main(["--model", model, "--dtypes", "float32", "--requests", "4", "--prompt-len", "6",
                        "--new-tokens", "3", "--repeats", "2", "--batch-invariant", "--structured", "--dora", "--combinations"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    row = report["float32"]
    labels = {"base", "single", "mixed8", "mixed8_invariant", "mixed8_json25", "mixed8_lora", "mixed8_dora",
              "mixed8_pairs", "mixed8_r16", "single_max32", "distinct32", "hf_base", "peft_mixed8"}
    assert set(row["runs_tok_s"]) == labels
    for label in labels:
        runs = row["runs_tok_s"][label]
        assert len(runs) == 2 and abs(row[label] - max(runs)) <= 0.1  # the best run is the reported one
        assert abs(row["median_tok_s"][label] - statistics.median(runs)) <= 0.1
    assert row["greedy_rows_equal_to_peft"] == 1.0  # fp32: every mixed row's greedy tokens equal PEFT's
    assert set(report["ratios"]) >= {"float32:mixed8/base", "float32:mixed8/peft_mixed8", "best:mixed8/peft_mixed8"}
    assert set(report["ratios_median"]) == set(report["ratios"])
    median = row["median_tok_s"]
    assert abs(report["ratios_median"]["float32:mixed8/base"] - median["mixed8"] / median["base"]) < 1e-9
    runs = row["runs_tok_s"]  # rounded to 0.1 tok/s in the JSON: compare loosely
    paired = statistics.median(m / b for m, b in zip(runs["mixed8"], runs["base"]))
    assert abs(report["ratios_paired"]["float32:mixed8/base"] - paired) < 1e-2 * paired
    assert set(report["ratios_paired"]) == {"float32:mixed8/base", "float32:distinct32/single(max_loras=32)",
                                            "float32:mixed8_invariant/mixed8", "float32:mixed8_json25/mixed8",
                                            "float32:mixed8_dora/mixed8_lora", "float32:mixed8_pairs/mixed8_r16"}


def test_a_benchmark_leaves_no_working_directory_behind(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import throughput; "
            "open(throughput.scratch_dir('loramux-bench-') + '/adapter', 'w').write('x')")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent)], env=env, check=True, timeout=120)
    assert os.listdir(tmp_path) == []  # a thousand adapters' worth of GBs otherwise, at every run


def test_latency_reports_ttft_and_decode_speed_with_and_without_an_adapter(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("latency", SCRIPT.parent / "latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = save_checkpoint(tiny_llama(), tmp_path / "model")
    module.main(["--model", model, "--dtype", "float32", "--prompt-len", "6", "--new-tokens", "4", "--repeats", "2",
                 "--skip-llama-cpp", "--skip-served"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for phase in ("loramux", "loramux_lora", "loramux_lora_bf16"):  # (fp32 model: bf16 LoRA weights too)
        assert report[phase]["ttft_ms"] > 0 and report[phase]["decode_tok_s"] > 0
        assert len(report[phase]["runs_decode_tok_s"]) == 2
    assert set(report["ratios"]) == {"loramux_lora/loramux decode", "loramux_lora_bf16/loramux decode"}


def test_moe_benchmark_reports_every_row_and_the_same_base_tokens_from_either_experts_op(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("moe_bench", SCRIPT.parent / "moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--workdir", str(tmp_path), "--shape", "tiny", "--requests", "8", "--prompt-len", "6",
                 "--new-tokens", "3", "--repeats", "1", "--peft-adapters", "1", "--dtype", "float32"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["tok_s"]) == {"base", "mixed8", "base_torch_op", "hf_base", "peft_per_adapter"}
    assert all(r["best"] > 0 for r in report["tok_s"].values())
    assert report["same_base_tokens"] is True
    assert report["mixed8_rows_equal_to_peft"] == 1.0  # fp32: every mixed row's greedy tokens equal PEFT's
    assert set(report["ratios"]) == {"mixed8 / base (paired)", "base / base_torch_op", "base / hf_base",
                                     "mixed8 / peft_per_adapter"}


def test_vs_vllm_runs_every_case_on_both_sides_and_reports_ratios(tmp_path, capsys):
    """loramux for real on a tiny checkpoint; vLLM's side through a stand-in for its venv's Python that
    checks the job it is sent and answers as benchmarks/vllm_offline.py does."""
    spec = importlib.util.spec_from_file_location("vs_vllm", SCRIPT.parent / "vs_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = save_checkpoint(tiny_llama(), tmp_path / "model")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec \"%s\" -c 'import json, sys\njob = json.load(sys.stdin)\n"
                    "assert len(job[\"adapters\"]) == 32 and job[\"max_loras\"] == 32 and len(job[\"prompts\"]) == 4\n"
                    "assert job[\"cases\"][\"mixed8\"] == [\"a0\", \"a1\", \"a2\", \"a3\"]\n"
                    "print(\"log line\"); print(json.dumps({\"tok_s\": {c: [10.0] for c in job[\"cases\"]}}))'\n"
                    % sys.executable)
    fake.chmod(0o755)
    module.main(["--model", model, "--workdir", str(tmp_path / "work"), "--requests", "4", "--prompt-len", "6",
                 "--new-tokens", "3", "--repeats", "1", "--dtype", "float32", "--vllm-python", str(fake)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["loramux"]) == set(report["vllm"]) == {"base", "single", "mixed8", "mixed32"}
    assert all(runs[0] > 0 for runs in report["loramux"].values())
    ratio = report["ratios"]["mixed8 loramux/vllm"]
    assert abs(ratio - report["best"]["loramux"]["mixed8"] / 10.0) < 1e-9


def test_the_chat_workload_resends_each_conversation_turn_after_turn(tmp_path):
    spec = importlib.util.spec_from_file_location("prefix_bench", SCRIPT.parent / "prefix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--chats", "3", "--turns", "4", "--new-tokens", "5"])
    rows = [json.loads(line) for line in open(module.chat_dataset(str(tmp_path / "chat.jsonl"), args))]
    assert len(rows) == 12 and all(r["output_tokens"] == 5 for r in rows)
    for i, row in enumerate(rows[3:], start=3):  # turn t of a chat starts with its turn t - 1, 3 rows before
        earlier = rows[i - 3]["prompt"]
        assert row["prompt"].startswith(earlier.removesuffix("\nAssistant:")) and len(row["prompt"]) > len(earlier)
    assert len({r["prompt"].split("\n")[0] for r in rows}) == 1  # one system prompt, shared by every chat


def test_the_combined_trace_keeps_each_session_on_one_adapter_with_zipf_popularity(tmp_path):
    spec = importlib.util.spec_from_file_location("multitenant_bench", SCRIPT.parent / "multitenant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--trace-requests", "400", "--new-tokens", "5", "--open-sessions", "4"])
    names = [f"t{i}" for i in range(1000)]
    adapters = module.trace_dataset(str(tmp_path / "trace.jsonl"), args, names)
    rows = [json.loads(line) for line in open(tmp_path / "trace.jsonl")]
    assert len(rows) == len(adapters) == 400 and all(r["output_tokens"] == 5 for r in rows)
    counts = {name: adapters.count(name) for name in set(adapters)}
    assert counts.get("t0", 0) > 3 * statistics.mean(counts.values())  # the most popular tenant far above the mean
    assert len({r["prompt"].split("\n")[0] for r in rows}) <= args.system_prompts  # system prompts shared
    for i, row in enumerate(rows):  # a later turn resends its conversation, on the conversation's adapter
        earlier = [j for j in range(i) if row["prompt"].startswith(rows[j]["prompt"].removesuffix("\nAssistant:") + "\n")]
        assert all(adapters[j] == adapters[i] for j in earlier)
    assert sum(r["prompt"].count("User:") > 1 for r in rows) > 100  # many requests are later turns of a chat


def test_mixed_attention_times_both_ways_and_reports_ratios(capsys):
    spec = importlib.util.spec_from_file_location("mixed_attention", SCRIPT.parent / "mixed_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--cases", "128+40", "200+16", "--repeats", "1"])  # asserts nothing about speed: a smoke run
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["ms_per_layer"]) == set(report["ratios"]) == {"128+40", "200+16"}
    assert all(row["per_prompt"] > 0 and row["padded"] > 0 for row in report["ms_per_layer"].values())
    if module.attention_cpu.available():  # the engine's way on this CPU: every token a row of the decode op
        assert all(row["rows"] > 0 for row in report["ms_per_layer"].values())


def test_the_base_runs_serve_no_adapter_and_vllm_runs_without_lora(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("multitenant_bench", SCRIPT.parent / "multitenant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "serve", lambda cmd, port, **kwargs: cmd)  # the command, not a server
    args = module.parse_args([])
    assert [module.adapter_count(r) for r in ("loramux 1000, on demand", "vllm base")] == [1000, 0]
    vllm, ours = (module.start(f"{side} base", args, "M", {}, str(tmp_path)) for side in ("vllm", "loramux"))
    assert not {"--enable-lora", "--max-loras", "--lora-modules"} & set(vllm)
    assert "--max-loras" in ours and "--lora-modules" not in ours  # LoRA on, nothing registered
    with_lora = module.start("vllm 8", args, "M", {"t0": "/a/t0"}, str(tmp_path))
    assert {"--enable-lora", "--max-loras"} <= set(with_lora) and "t0=/a/t0" in with_lora


def test_the_host_16_runs_hold_16_adapters_in_host_memory_and_16_slots(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("multitenant_bench", SCRIPT.parent / "multitenant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "serve", lambda cmd, port, **kwargs: cmd)
    args = module.parse_args([])

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    pressured = module.start("loramux 64, host 16", args, "M", {f"t{i}": f"/a/t{i}" for i in range(64)}, str(tmp_path))
    assert flag(pressured, "--max-loras") == flag(pressured, "--max-cpu-loras") == "16"
    assert "--lora-modules" not in pressured and "store_resolver:StoreResolver" in pressured  # read on first use
    baseline = module.start("loramux 64, all in host, 16 slots", args, "M", {f"t{i}": "/a" for i in range(64)},
                            str(tmp_path))
    assert (flag(baseline, "--max-loras"), flag(baseline, "--max-cpu-loras")) == ("16", "64")
    registered = module.start("loramux 64, registered, host tier 16, 16 slots", args, "M",
                              {f"t{i}": "/a" for i in range(64)}, str(tmp_path))
    assert flag(registered, "--max-loras") == flag(registered, "--max-cpu-loras") == "16"
    assert "--lora-modules" in registered and "store_resolver:StoreResolver" not in registered  # no store: pressure alone
    same_store = module.start("loramux 64, host 64, 16 slots", args, "M", {f"t{i}": "/a" for i in range(64)},
                              str(tmp_path))
    assert (flag(same_store, "--max-loras"), flag(same_store, "--max-cpu-loras")) == ("16", "64")
    assert "--lora-modules" not in same_store and "store_resolver:StoreResolver" in same_store  # the same first reads
    assert flag(module.start("loramux 8", args, "M", {"t0": "/a"}, str(tmp_path)), "--max-loras") == str(args.max_loras)


def test_the_slo_capacity_steps_the_rate_until_it_brackets_the_share(tmp_path, monkeypatch):
    """Doubling while >= 90% of the requests meet the SLOs, halving while not; the highest rate that held."""
    spec = importlib.util.spec_from_file_location("multitenant_bench", SCRIPT.parent / "multitenant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    limit = {"loramux": 5.0, "vllm": 0.3}  # a side meets the SLOs below its limit
    tried = []

    def run(args, side, rate, *rest):
        tried.append((side, rate))
        good = 1.0 if rate < limit[side] else 0.5
        return {"request_goodput": good * rate, "duration_s": args.trace_requests / rate}

    monkeypatch.setattr(module, "_trace_run", run)
    args = module.parse_args(["--trace-requests", "20", "--capacity-start", "2", "0.5"])
    found = module.capacity(args, "M", str(tmp_path), {f"t{i}": "/a" for i in range(10)}, str(tmp_path))
    assert found["loramux"]["capacity"] == 4.0 and found["vllm"]["capacity"] == 0.25
    assert tried == [("loramux", 2.0), ("loramux", 4.0), ("loramux", 8.0), ("vllm", 0.5), ("vllm", 0.25)]
    assert found["vllm"]["share_meeting_slo"] == {"0.5": 0.5, "0.25": 1.0}
    limit["vllm"], tried[:] = 0.1, []
    assert module.capacity(args, "M", str(tmp_path), {"t0": "/a"}, str(tmp_path))["vllm"]["capacity"] == 0.0
    assert tried[-2:] == [("vllm", 0.5), ("vllm", 0.25)]  # never below --capacity-floor (0.25)


def test_startup_alternates_the_servers_and_reports_medians_and_ratios(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("startup", SCRIPT.parent / "startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").touch()
    order, times = [], {"loramux": iter([(6.0, 1.0), (5.0, 0.5), (7.0, 1.5)]), "vllm": iter([(40.0, 2.0)] * 3)}
    monkeypatch.setattr(module, "start_and_stop", lambda side, args: order.append(side) or next(times[side]))
    module.main(["--vllm-venv", str(tmp_path), "--repeats", "3"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert order == ["loramux", "vllm"] * 3
    assert report["sides"]["loramux"]["start_s"] == [6.0, 5.0, 7.0] and report["sides"]["loramux"]["start_median_s"] == 6.0
    assert report["ratios"] == {"vllm/loramux start": 40.0 / 6.0, "vllm/loramux stop": 2.0}
    import loramux.models.loader

    monkeypatch.setattr(loramux.models.loader, "default_model_path", lambda: "/hf/SmolLM2")  # (no conversion)
    vllm, env = module.command("vllm", argparse.Namespace(vllm_venv=str(tmp_path)), 8123)
    assert vllm[:3] == [str(tmp_path / "bin" / "vllm"), "serve", "/hf/SmolLM2"] and "--enable-lora" in vllm
    assert [a.split("=")[0] for a in vllm[vllm.index("--lora-modules") + 1:]] == ["pirate", "french", "json"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_the_gpu_check_runs_every_step_and_reports_each_as_a_json_line(tmp_path):
    """benchmarks/gpu_check.sh end to end, on the CPU with the tiny shape (what a GPU round runs, smaller): every
    step ends with rc 0 and its JSON result, PEFT's greedy rows are compared, and the Triton cache comes back."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu",
           "GPU_CHECK_SHAPES": "tiny", "GPU_CHECK_WORKDIR": str(tmp_path / "work"),
           "GPU_CHECK_CACHE": str(tmp_path / "cache"), "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
           "GPU_CHECK_ARGS": "--requests 4 --prompt-len 8 --new-tokens 4"}
    done = subprocess.run(["bash", str(SCRIPT.parent / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = {row["step"]: row for row in map(json.loads, (out / "gpu_check.jsonl").read_text().splitlines())}
    assert list(steps) == ["vs_vllm_tiny", "batch1_tiny", "peft_tiny", "profile_tiny", "tune_tiny"]  # (+ eager: GPU)
    assert steps["batch1_tiny"]["result"]["enforce_eager"] is False
    assert all(row["rc"] == 0 and row["result"] and row["device"] == "cpu" for row in steps.values()), steps
    assert set(steps["vs_vllm_tiny"]["result"]["best"]["loramux"]) == {"base", "single", "mixed8", "mixed32"}
    assert 0 <= steps["peft_tiny"]["result"]["bfloat16"]["greedy_rows_equal_to_peft"] <= 1
    assert steps["profile_tiny"]["result"]["step_ms"] > 0
    assert (out / "triton-cache.tgz").stat().st_size > 0 and "=== done" in (out / "gpu_check.log").read_text()
    assert set(json.loads((out / "tuned" / "cpu.json").read_text())) == {"lora", "attention"}


def test_tune_triton_writes_a_table_the_kernels_read(tmp_path, capsys, monkeypatch):
    """benchmarks/tune_triton.py on the CPU (Triton's interpreter), the tiny shape and two candidates a size:
    every size gets an entry of the kernels' own fields, and the table loads as their tiles."""
    import dataclasses

    from loramux.ops import lora_triton, triton_tiles

    if not lora_triton.available("cpu"):
        pytest.skip("needs triton (its interpreter runs here)")
    module = load_script("tune_triton")
    result = module.main(["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--tokens", "1", "3",
                          "--batches", "2", "--quick", "--out", str(tmp_path)])
    table = json.loads((tmp_path / "cpu.json").read_text())
    assert set(table["lora"]) == {"1", "3"} and set(table["attention"]) == {"2"}
    assert set(result["gain"]["lora"]) == {1, 3} and all(g >= 1 for g in result["gain"]["lora"].values())
    monkeypatch.setattr(triton_tiles, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(triton_tiles, "gpu_name", lambda device: "cpu")
    triton_tiles.tuned_table.cache_clear()
    try:
        for n in (1, 3):
            fields = dataclasses.asdict(triton_tiles.lora_tiles("cpu", n))
            assert fields == {**dataclasses.asdict(triton_tiles.LoRATiles()), **table["lora"][str(n)]}
    finally:
        triton_tiles.tuned_table.cache_clear()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["benchmark"] == "tune_triton"


def test_alora_times_the_intrinsic_with_the_base_conversation_cached_and_cold(tmp_path, capsys):
    model = save_checkpoint(tiny_llama(), tmp_path / "model")
    result = load_script("alora").main(["--model", model, "--config", model, "--dtype", "float32",
                                        "--conversation", "40", "--repeats", "2"])
    assert result["cached_tokens"] == [32, 32]  # the conversation's full blocks of 16, from the base model's turn
    assert set(result["ttft_ms"]) == {"cached", "cold", "plain_after_base"} and result["ratios"]["cached/cold"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["benchmark"] == "alora"


def test_speculative_runs_every_prompt_with_and_without_speculation_and_the_batch(tmp_path, capsys):
    model = save_checkpoint(tiny_llama(max_position_embeddings=2048), tmp_path / "model")
    with open(os.path.join(model, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}>")
    load_script("speculative").main(["--model", model, "--config-dir", model, "--dtype", "float32",
                                     "--max-tokens", "12", "--repeats", "1", "--skip-llama-cpp", "--batch"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["prompts"]) == {"edit", "document", "code", "fresh"}
    for phases in report["prompts"].values():
        assert phases["spec"]["tokens"] == phases["plain"]["tokens"] and phases["spec"]["decode_tok_s"] > 0
    assert report["batch"]["batch_spec"] > 0 and 0 <= report["batch"]["acceptance"] <= 1
    assert "edit: spec/plain" in report["ratios"] and "batch 32: spec/plain" in report["ratios"]


def test_repeated_runs_alternate_their_order_and_report_each_numbers_mean():
    """ABBA: a side that always ran second would take the machine's drift in speed alone."""
    spec = importlib.util.spec_from_file_location("multitenant_bench", SCRIPT.parent / "multitenant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    order = []

    def one(run):
        order.append(run)
        return {"output_throughput": 100.0 * len(order), "p99_tpot_ms": 10.0, "request_rate": "inf"}

    found = module.repeated(["a", "b"], 4, one)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert found["a"]["output_throughput"] == statistics.fmean([100, 400, 500, 800]) == found["b"]["output_throughput"]
    assert [r["output_throughput"] for r in found["b"]["repeats"]] == [200, 300, 600, 700]
    assert found["a"]["request_rate"] == "inf" and found["a"]["p99_tpot_ms"] == 10.0
    assert module.repeated(["a"], 1, lambda run: {"x": 1}) == {"a": {"x": 1}}
