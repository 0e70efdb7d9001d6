"""The command line: `loramux generate` and `loramux bench` on a tiny checkpoint."""
import json

import pytest

from conftest import save_checkpoint, save_peft_adapter, tiny_llama
from loramux.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = tiny_llama()
    return save_checkpoint(base, root / "model"), save_peft_adapter(base, root / "a", r=8)


def test_generate_prints_one_answer_per_adapter(tiny, capsys):
    model, adapter = tiny
    main(["generate", "--model", model, "--dtype", "float32", "--lora-modules", f"a={adapter}",
          "--prompt", "hello", "--adapter", "a", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "--- a (length)" in out


def test_bench_prints_a_table_and_writes_a_chart(tiny, tmp_path, capsys):
    model, _ = tiny
    chart = tmp_path / "chart.png"
    main(["bench", "--model", model, "--dtypes", "float32", "--batch-sizes", "1", "4", "--distinct", "1", "2", "4",
          "--prompt-len", "6", "--new-tokens", "3", "--chart", str(chart)])
    out = capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.strip().splitlines()[-2])
    assert set(result["by_batch"]) == {"1", "4"} and set(result["by_distinct"]) == {"1", "2", "4"}
    assert all(v > 0 for row in result["by_batch"].values() for v in row.values())
    assert "distinct adapters" in out


def test_serve_passes_its_flags_to_the_server(monkeypatch):
    import loramux.server.http.app as app
    import loramux.server.supervisor as supervisor

    from fastapi import FastAPI

    seen = {}

    def build_app(engine, server, modules):
        seen.update(engine=engine, server=server)
        return FastAPI()

    def supervise(engine, server, modules, log_level):
        assert (engine, server) == (seen["engine"], seen["server"])  # what was checked is what runs
        seen.update(port=server.port, grace=server.shutdown_timeout, log_level=log_level)
        return 0

    monkeypatch.setattr(app, "build_app", build_app)
    monkeypatch.setattr(supervisor, "supervise", supervise)
    with pytest.raises(SystemExit) as exit_code:
        main(["serve", "--port", "8123", "--max-body-bytes", "2048", "--api-key", "k", "--max-loras", "2",
              "--max-pending-requests", "9", "--max-pending-tokens", "999", "--max-pending-per-client", "3",
              "--max-prompts-per-request", "5", "--shutdown-timeout", "7", "--num-threads", "1",
              "--enable-chunked-prefill", "--max-num-batched-tokens", "96", "--enable-auto-tool-choice",
              "--tool-call-parser", "hermes", "--log-level", "debug"])
    assert exit_code.value.code == 0
    assert seen["port"] == 8123 and seen["engine"].lora.max_loras == 2 and seen["grace"] == 7
    engine = seen["engine"]
    assert (engine.num_threads, engine.enable_chunked_prefill, engine.max_num_batched_tokens) == (1, True, 96)
    assert engine.batch_invariant is False  # (refused with chunked prefill below)
    assert engine.usage == "server"  # served defaults (a GPU's step budget)
    import logging
    assert logging.getLogger("loramux.server").getEffectiveLevel() == logging.DEBUG
    assert seen["server"].tool_call_parser == "hermes"
    server = seen["server"]
    assert server.max_body_bytes == 2048 and server.api_key == "k" and server.shutdown_timeout == 7
    assert (server.max_pending_requests, server.max_pending_tokens, server.max_pending_per_client,
            server.max_prompts_per_request) == (9, 999, 3, 5)
    with pytest.raises(SystemExit, match="max_body_bytes"):  # a bad value: its message, no traceback
        main(["serve", "--max-body-bytes", "0"])
    with pytest.raises(SystemExit, match="cannot be combined with enable_chunked_prefill"):
        main(["serve", "--batch-invariant", "--enable-chunked-prefill"])
    with pytest.raises(SystemExit):
        main(["serve", "--batch-invariant", "--quantization", "int4", "--quantization-group-size", "64"])
    assert seen["engine"].batch_invariant is True
    assert (seen["engine"].quantization, seen["engine"].quantization_group_size) == ("int4", 64)
    with pytest.raises(SystemExit):
        main(["serve", "--lora-target-modules", "q_proj", "embed_tokens", "lm_head", "--max-module-copies-bytes",
              "1000", "--max-cpu-lora-bytes", "5000000", "--lora-dtype", "bfloat16", "--max-grammar-choices", "50000"])
    lora = seen["engine"].lora
    assert lora.targets == ("q_proj", "embed_tokens", "lm_head") and lora.max_module_copies_bytes == 1000
    assert lora.max_cpu_lora_bytes == 5_000_000 and lora.lora_dtype == "bfloat16"
    assert seen["engine"].grammar_limits.max_choices == 50_000

    with pytest.raises(SystemExit, match="--enable-auto-tool-choice"):
        main(["serve", "--tool-call-parser", "hermes"])
    with pytest.raises(SystemExit):
        main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    spec = seen["engine"].speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 4, 4)
    with pytest.raises(SystemExit, match="speculative config: unknown key.*'draft_model'"):
        main(["serve", "--speculative-config", '{"draft_model": "x"}'])


def test_serve_refuses_a_bare_path_that_is_no_adapter_name(monkeypatch):
    import loramux.server.supervisor as supervisor

    monkeypatch.setattr(supervisor, "supervise", lambda *args: pytest.fail("the server must not start"))
    with pytest.raises(SystemExit, match="a bare path names the adapter after itself.*write NAME=/abs/pirate"):
        main(["serve", "--lora-modules", "/abs/pirate"])  # clients could never send that name as `model`


def test_serve_replicas_runs_the_ray_serve_app_with_its_flags(monkeypatch):
    pytest.importorskip("ray.serve")
    import loramux.server.ray.ingress as ray_ingress

    seen = {}
    monkeypatch.setattr(ray_ingress, "run", lambda *args: seen.update(args=args))
    main(["serve", "--replicas", "3", "--ray-address", "10.0.0.1:6379", "--max-adapters-per-replica", "5",
          "--lora-modules", "a=/x/a", "--port", "8124"])
    engine, server, modules, replicas, address, per_replica = seen["args"]
    assert (modules, replicas, address, per_replica, server.port) == (["a=/x/a"], 3, "10.0.0.1:6379", 5, 8124)
    with pytest.raises(SystemExit, match="--replicas must be >= 1"):
        main(["serve", "--replicas", "-1"])
    with pytest.raises(SystemExit, match="--listen-fd .* is for one server"):
        main(["serve", "--replicas", "2", "--listen-fd", "3"])  # Serve binds its own socket: not taken and ignored


def test_prepare_builds_every_cpu_kernel_and_the_default_models_files(capsys):
    import glob
    import os

    from loramux.ops.cpu_extension import CSRC

    main(["prepare"])
    out = capsys.readouterr().out
    for source in glob.glob(os.path.join(CSRC, "*.cpp")):
        assert f"CPU kernel {os.path.basename(source)[:-4]}: " in out
    assert "embedded default model: " in out and ".gguf" in out
    from loramux.models.loader import _gguf_index_file, default_gguf_path

    assert os.path.isfile(_gguf_index_file(default_gguf_path()))  # a start maps the file, parsing nothing


def test_generate_exits_with_the_refusal_of_an_adapter_it_cannot_load(tiny, tmp_path):
    model, _ = tiny
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", model, "--dtype", "float32", "--lora-modules", f"b={broken}",
              "--prompt", "hello", "--adapter", "b", "--max-tokens", "4"])
    assert str(exit_.value.code).startswith(f"--lora-modules adapter 'b={broken}': ")
