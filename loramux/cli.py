"""loramux serve | generate | bench."""
from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys

from loramux.adapters.names import parse_adapter_arg
from loramux.adapters.remote import check_uri
from loramux.config import LORA_DTYPES, EngineConfig, GrammarLimits, LoRAConfig, ServerConfig
from loramux.logs import log_to_stderr

# structured outputs' limits: (flag, type, GrammarLimits field, help); the default is the field's
_GRAMMAR_LIMITS = (
    ("--max-grammar-bytes", int, "max_bytes", "bytes of a structured output's schema, regex, grammar or choices"),
    ("--max-grammar-choices", int, "max_choices", "items of a choice list (guided_choice)"),
    ("--max-grammar-rules", int, "max_rules", "rules of a Lark or GBNF grammar"),
    ("--max-grammar-alternatives", int, "max_alternatives", "alternatives of one grammar rule"),
    ("--max-grammar-nesting", int, "max_nesting", "nesting depth of a JSON schema"),
    ("--grammar-check-timeout", float, "check_timeout_s", "seconds the server may take to check and compile one "
                                                          "new structured output (in a worker process)"),
    ("--grammar-check-memory", int, "check_memory_bytes", "address space of that worker process, in bytes"),
    ("--grammar-cache-bytes", int, "cache_bytes", "grammar text behind the engine's cache of compiled grammars"),
)


def _adapter_args(adapters) -> None:
    """The adapters group of the engine's flags."""
    adapters.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH", help="adapters to load at start-up")
    adapters.add_argument("--max-loras", type=int, default=4, help="adapters in one batch (device slots)")
    adapters.add_argument("--max-cpu-loras", type=int, default=None,
                          help="adapters kept in host memory (default: 16, or --max-loras if that is more)")
    adapters.add_argument("--max-cpu-lora-bytes", type=int, default=None,
                          help="host memory for adapters in bytes too (default: counted by --max-cpu-loras only); the "
                               "least recently used leave until a new one fits")
    adapters.add_argument("--max-lora-spill-bytes", type=int, default=LoRAConfig.max_spill_bytes,
                          help="disk for the built host copies of adapters that left host memory (default 4 GiB): "
                               "one that comes back with its files unchanged is read from there, not built again; "
                               "0 = off")
    adapters.add_argument("--lora-spill-dir", default=None, metavar="DIR",
                          help="where that disk is (an anonymous file, gone with the process; default: "
                               "~/.cache/loramux/spill); on a tmpfs the copies would stay in memory")
    adapters.add_argument("--max-lora-rank", type=int, default=64)
    adapters.add_argument("--lora-load-timeout", type=float, default=60.0, metavar="SECONDS",
                          help="how long a pinned load waits for host memory and a device slot held by requests in "
                               "use (unpinned loads never wait: they are read into host memory on use)")
    adapters.add_argument("--lora-keep-revisions", type=int, default=1, metavar="N",
                          help="revisions of each adapter name kept addressable as name@rev (1: only the current "
                               "one); a reload in place keeps the N - 1 before it, for rollouts still on them")
    adapters.add_argument("--lora-dtype", default="auto", choices=LORA_DTYPES,
                          help="the LoRA weights' dtype (default: the activations'); bfloat16 on a float32 model (a "
                               "GGUF's default) halves what an adapter costs a decode step at batch 1")
    adapters.add_argument("--lora-target-modules", nargs="*", default=None, metavar="MODULE",
                          help="modules that get LoRA layers (default: the 7 projections); add embed_tokens and "
                               "lm_head for embedding / output-head LoRA")
    adapters.add_argument("--max-module-copies-bytes", type=int, default=0,
                          help="bytes for adapters' whole copies of embed_tokens / lm_head (PEFT modules_to_save); "
                               "0 = such adapters are refused")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    adapters = parser.add_argument_group("adapters")
    batching = parser.add_argument_group("batching and speed")
    grammar = parser.add_argument_group("structured outputs' limits")
    model.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    _adapter_args(adapters)
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    model.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "bitsandbytes"],
                       help="the base model's weights: (not given) as the checkpoint is, a GGUF, GPTQ/AWQ or "
                            "bitsandbytes 4-bit checkpoint stays quantized; none = dequantized to --dtype; int8 / "
                            "int4 / bitsandbytes (NF4) = quantized at load")
    model.add_argument("--quantization-group-size", type=int, default=128, choices=[32, 64, 128],
                       help="inputs per scale for --quantization int4")
    model.add_argument("--device", default="auto")
    model.add_argument("--max-model-len", type=int, default=None)
    batching.add_argument("--max-num-seqs", type=int, default=64)
    batching.add_argument("--num-threads", type=int, default=None,
                          help="the engine's CPU threads (default: torch's, one per core or OMP_NUM_THREADS)")
    for flag, kind, field, help_text in _GRAMMAR_LIMITS:
        grammar.add_argument(flag, type=kind, default=getattr(GrammarLimits, field), help=help_text)
    batching.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                          help="mix decode rows and prompt chunks in every step (as vLLM V1; on by default, off with "
                               "--batch-invariant): running requests keep streaming while long prompts start")
    batching.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                          help="share full KV blocks between requests of the same adapter whose prompts start alike "
                               "(as vLLM V1; on by default, off with --batch-invariant)")
    batching.add_argument("--max-num-batched-tokens", type=int, default=None,
                          help="tokens per step at most (default: 256 on a CPU; on a GPU as vLLM's, served 2048, 8192 "
                               "on one of >= 70 GiB, offline 8192 / 16384; unchunked: 4096)")
    batching.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                          help="fcfs (requests' priority must be 0) or priority: lower `priority` first, and preempted "
                               "last (as vLLM's)")
    batching.add_argument("--enforce-eager", action="store_true",
                          help="decode on a GPU op by op, without CUDA graphs (as vLLM's; graphs are captured at start "
                               "for batch sizes 1, 2, 4, 8, 16, ... up to --max-num-seqs)")
    batching.add_argument("--speculative-config", default=None, metavar="JSON",
                          help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 5, '
                               '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (each decoding request proposes the '
                               'tokens that followed its last n tokens earlier; one pass with its adapter keeps those '
                               'the model agrees with: the same output, fewer passes where text repeats)')
    batching.add_argument("--batch-invariant", action="store_true",
                          help="a request's tokens never depend on its batch mates, bf16 included (as vLLM's "
                               "VLLM_BATCH_INVARIANT; slower: see docs/reliability.md)")


def _engine_config(args, usage: str) -> EngineConfig:
    targets = tuple(args.lora_target_modules) if args.lora_target_modules else None
    lora = LoRAConfig(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                      max_lora_rank=args.max_lora_rank, target_modules=targets,
                      max_module_copies_bytes=args.max_module_copies_bytes,
                      max_cpu_lora_bytes=args.max_cpu_lora_bytes, lora_dtype=args.lora_dtype,
                      load_timeout_s=args.lora_load_timeout, keep_revisions=args.lora_keep_revisions,
                      max_spill_bytes=args.max_lora_spill_bytes, spill_dir=args.lora_spill_dir)
    budget = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    grammar = GrammarLimits(**{field: getattr(args, flag[2:].replace("-", "_")) for flag, _, field, _ in _GRAMMAR_LIMITS})
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, lora=lora, quantization=args.quantization,
                        grammar_limits=grammar,
                        quantization_group_size=args.quantization_group_size,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        enable_chunked_prefill=args.enable_chunked_prefill, num_threads=args.num_threads,
                        prefill_slowdown_cap=getattr(args, "prefill_slowdown_cap", None),
                        enable_prefix_caching=args.enable_prefix_caching,
                        batch_invariant=args.batch_invariant, enforce_eager=args.enforce_eager, usage=usage, scheduling_policy=args.scheduling_policy,
                        speculative_config=args.speculative_config, **budget)


def serve(args) -> None:
    from loramux.server.http.app import build_app
    from loramux.server.supervisor import supervise

    log_to_stderr(args.log_level)
    if args.replicas:
        return _serve_scaleout(args)
    try:
        engine, config = _engine_config(args, "server"), _server_config(args)
        build_app(engine, config, args.lora_modules)  # every flag checked here, before anything starts
    except ValueError as e:  # a flag's value: the message names it (no traceback for a typo)
        sys.exit(f"loramux serve: {e}")
    try:
        sys.exit(supervise(engine, config, args.lora_modules, args.log_level))
    except ValueError as e:  # --listen-fd that is no listening socket
        sys.exit(f"loramux serve: {e}")
    except OSError as e:  # the port is taken, ...
        sys.exit(f"loramux serve: cannot listen on {args.host}:{args.port}: {e}")


def _serve_scaleout(args) -> None:
    """--replicas N: the same server N times behind one endpoint, on Ray Serve (server/ray/ingress.py)."""
    if args.replicas < 1:
        sys.exit(f"loramux serve: --replicas must be >= 1, got {args.replicas}")
    try:
        from loramux.server.ray import ingress as ray_ingress
    except ImportError as e:
        sys.exit(f"loramux serve --replicas needs Ray Serve: pip install 'ray[serve]' ({e})")
    try:
        engine, config = _engine_config(args, "server"), _server_config(args)
        ray_ingress.check(config)
        for spec in args.lora_modules:
            parse_adapter_arg(spec)
    except ValueError as e:
        sys.exit(f"loramux serve: {e}")
    ray_ingress.run(engine, config, args.lora_modules, args.replicas, args.ray_address, args.max_adapters_per_replica)


# serve's flags for ServerConfig's limits: (flag, type, field, help); the default is the field's
_SERVER_LIMITS = (
    ("--max-body-bytes", int, "max_body_bytes", "larger request bodies get 413 (default: 1 MiB)"),
    ("--max-adapter-upload-bytes", int, "max_adapter_upload_bytes", "an adapter's files sent in the body of "
                                                                    "/v1/load_lora_adapter (multipart) up to this "
                                                                    "size; 0 = uploads off"),
    ("--max-adapter-download-bytes", int, "max_adapter_download_bytes", "a remote adapter's files together at most "
                                                                        "this size (default: 1 GiB)"),
    ("--adapter-download-timeout", float, "adapter_download_timeout", "seconds a remote adapter's fetch may take "
                                                                      "(default: 300)"),
    ("--max-pending-requests", int, "max_pending_requests", "engine requests in flight at most; past it, 429 with "
                                                            "Retry-After"),
    ("--max-pending-tokens", int, "max_pending_tokens", "prompt tokens + max_tokens in flight at most; past it, 429"),
    ("--max-pending-per-client", int, "max_pending_per_client", "requests in flight per client (API key or "
                                                                "address); 0 = no limit"),
    ("--max-resolves-per-client", int, "max_resolves_per_client", "cold adapter names one client has resolving "
                                                                  "at once (its others wait); 0 = no limit"),
    ("--max-connections", int, "max_connections", "open connections at most (0: the file limit less a margin); past "
                                                   "it the oldest one waiting for a request is closed"),
    ("--max-connections-per-client", int, "max_connections_per_client", "open connections per client address; "
                                                                        "past it its oldest idle one is closed"),
    ("--header-timeout", float, "header_timeout", "seconds a connection has to send a whole request head (after it "
                                                  "opens, and after each response) before it is closed"),
    ("--max-prompts-per-request", int, "max_prompts_per_request", "prompts x n in one HTTP request at most (400)"),
    ("--shutdown-timeout", float, "shutdown_timeout", "on SIGTERM, seconds running requests get to finish before "
                                                      "they end with an error"),
    ("--engine-unresponsive-timeout", float, "engine_unresponsive_s", "seconds without an engine heartbeat before "
                                                                      "/health answers 503"),
    ("--engine-kill-timeout", float, "engine_kill_s", "seconds without an engine heartbeat before the frozen "
                                                      "engine is killed and restarted"),
)


def _float_or_none(value: str) -> float | None:
    return None if value.lower() == "none" else float(value)


def _server_config(args) -> ServerConfig:
    limits = {field: getattr(args, flag[2:].replace("-", "_")) for flag, _, field, _ in _SERVER_LIMITS}
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        sys.exit("--tool-call-parser is used by tool_choice \"auto\": add --enable-auto-tool-choice")
    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    if args.enable_auto_tool_choice and parser is None:
        sys.exit("--enable-auto-tool-choice needs --tool-call-parser (one of: hermes)")
    config = ServerConfig(host=args.host, port=args.port, listen_fd=args.listen_fd, served_model_name=args.served_model_name,
                          api_key=args.api_key, public_metrics=args.public_metrics, tenants_file=args.tenants, allowed_adapter_dirs=tuple(args.allowed_adapter_dir),
                          lora_resolver_dirs=tuple(args.lora_resolver_dir), lora_resolver_hf=args.lora_resolver_hf,
                          lora_resolvers=tuple(args.lora_resolver), tool_call_parser=parser,
                          allowed_adapter_uris=tuple(args.allowed_adapter_uri),
                          lora_resolver_uris=tuple(args.lora_resolver_uri), **limits)
    from loramux.server.http.on_demand import build_resolvers

    build_resolvers(config)  # a directory that is not one, a plugin that does not import: ValueError naming it
    for prefix in config.allowed_adapter_uris:
        check_uri(prefix, (prefix,))  # a scheme no backend serves: ValueError naming it
    return config


def _serve_args(p: argparse.ArgumentParser) -> None:
    _engine_args(p)
    server = p.add_argument_group("server")
    access = p.add_argument_group("access: keys, tenants, runtime loads")
    on_demand = p.add_argument_group("adapters on demand")
    limits = p.add_argument_group("admission and limits")
    scaleout = p.add_argument_group("scale-out (Ray Serve)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                        help="serve on this inherited, already listening socket instead of binding --host/--port (for "
                             "a parent process that opened it: no one can take the port in between)")
    access.add_argument("--api-key", default=None, help="the operator's key: every route, every adapter")
    access.add_argument("--public-metrics", action="store_true",
                        help="/metrics without a key, as /health (for scrapers that send none, such as an inference "
                             "gateway's endpoint picker); it names every tenant's adapters")
    access.add_argument("--tenants", default=None, metavar="FILE",
                        help="a TOML file of tenants: each one's API key hashes, the adapter names it may use and change, "
                             "its limits and fair share (docs/server.md, Tenants); reloaded on SIGHUP")
    access.add_argument("--allowed-adapter-dir", nargs="*", default=[], metavar="DIR",
                        help="directories /v1/load_lora_adapter may load from (none: runtime loads are off)")
    access.add_argument("--allowed-adapter-uri", action="append", default=[], metavar="PREFIX",
                        help="URI prefixes /v1/load_lora_adapter may load from too (s3://bucket/dir, gs://..., "
                             "https://host/path, hf://org; repeatable): fetched into a local cache first")
    on_demand.add_argument("--lora-resolver-dir", action="append", default=[], metavar="DIR",
                           help="adapters on demand: a `model` that names no registered adapter is loaded from DIR/<model> "
                                "on its first request (repeatable; asked in order)")
    on_demand.add_argument("--lora-resolver-uri", action="append", default=[], metavar="PREFIX",
                           help="adapters on demand from a store: PREFIX/<model>/ (s3://, gs://, http(s)://, hf://; "
                                "repeatable), fetched into a local cache on the first request")
    on_demand.add_argument("--lora-resolver-hf", action="store_true",
                           help="adapters on demand from the local Hugging Face cache (a Hub id, org/name), downloaded there "
                                "first unless HF_HUB_OFFLINE=1")
    on_demand.add_argument("--lora-resolver", action="append", default=[], metavar="MODULE:ATTR",
                           help="an adapter resolver plugin (an object with resolve(base_model, name) -> directory or None, "
                                "or a class making one); those in the entry-point group loramux.lora_resolvers are used too")
    server.add_argument("--served-model-name", default=None)
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto": parse tool calls from the model\'s text (needs --tool-call-parser)')
    server.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                        help="the tool-call format the model writes: hermes = <tool_call>{json}</tool_call> (Hermes, Qwen, "
                             "SmolLM3)")
    for flag, kind, field, help_text in _SERVER_LIMITS:
        limits.add_argument(flag, type=kind, default=getattr(ServerConfig, field), help=help_text)
    limits.add_argument("--prefill-slowdown-cap", type=_float_or_none, default=2.0,
                        help="a step takes prompt tokens up to about this many times the time of a decode step (learned "
                             "as it runs), so that streams and arriving requests are not held behind long prompts; none "
                             "= only --max-num-batched-tokens bounds a step (more prefill throughput)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    scaleout.add_argument("--replicas", type=int, default=0,
                          help="scale out: N engine replicas behind one endpoint on Ray Serve, adapters routed to the "
                               "replicas that hold them (needs ray[serve]; 0 = one server, no Ray)")
    scaleout.add_argument("--ray-address", default=None,
                          help="with --replicas: join this Ray cluster (e.g. 10.0.0.1:6379, after `ray start --head`); "
                               "default: start a local one")
    scaleout.add_argument("--max-adapters-per-replica", type=int, default=16,
                          help="with --replicas: adapters one replica holds before Serve evicts its least recently used")


def generate(args) -> None:
    from loramux.llm import LLM, AdapterRefusedError
    from loramux.sampling_params import SamplingParams

    config = _engine_config(args, "offline")
    try:  # every engine flag; LLM loads the adapters and wraps what they need
        llm = LLM(adapters=args.lora_modules, **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    except AdapterRefusedError as e:
        sys.exit(f"--lora-modules {e}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    run = llm.chat if args.chat else llm.generate
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    adapters = args.adapter or [None]
    outputs = run([prompt] * len(adapters), params, adapters=adapters)
    for adapter, out in zip(adapters, outputs):
        print(f"--- {adapter or 'base'} ({out.finish_reason})\n{out.text}")


def bench(args) -> None:
    """Run the checkout's benchmarks/throughput.py --sweep (table + PNG chart); extra args pass through."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(repo, "benchmarks", "throughput.py")
    if not os.path.isfile(script):
        sys.exit(f"loramux bench runs benchmarks/throughput.py from a loramux checkout; {script} is missing")
    runpy.run_path(script)["main"](["--sweep", *args.args])


def prepare(args) -> None:
    """Build the C++ CPU kernels and read the embedded default's config and tokenizer now, so that a first
    start takes seconds (`make` runs this when it makes the venv)."""
    import time

    from loramux.ops.cpu_extension import build_all

    for name, built, seconds in build_all():
        print(f"CPU kernel {name}: {'ready' if built else 'not used on this machine (the torch path runs)'} "
              f"({seconds:.0f} s)", flush=True)
    if not args.skip_model:
        from loramux.models.loader import prepare_default_gguf

        started = time.monotonic()
        print(f"embedded default model: {prepare_default_gguf()} ({time.monotonic() - started:.0f} s)", flush=True)


def run_batch(args) -> None:
    """`loramux run-batch`: server/batch.py; the rest of the arguments go to `loramux serve`."""
    from loramux.server import batch

    if args.max_concurrency < 1:
        sys.exit(f"loramux run-batch: --max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        batch.run(args.input_file, args.output_file, args.args, args.max_concurrency)
    except (batch.BatchFileError, OSError, RuntimeError) as e:
        sys.exit(f"loramux run-batch: {e}")


def tenant_key(args) -> None:
    from loramux.server.http.tenants import new_key

    if not args.name or any(c in args.name for c in "\"\\\n"):
        sys.exit("loramux tenant-key: the name must be non-empty, with no quote, backslash or newline")
    key, line = new_key(args.name)
    print(f"API key for tenant {args.name!r} (shown once; give it to the tenant):\n  {key}\n"
          f"In the tenants file (add the keys line to the tenant's table; `kill -HUP` the server to apply):\n{line}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loramux", description="One base LLM, many LoRA adapters, one batch.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    _serve_args(p)
    p.set_defaults(func=serve)
    g = commands.add_parser("generate", help="generate offline, once per --adapter")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--adapter", nargs="*", default=None, help="adapter names (None: the base model)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=generate)
    b = commands.add_parser("bench", help="throughput curves and a PNG chart (benchmarks/throughput.py --sweep)",
                            description="Arguments are passed to benchmarks/throughput.py --sweep: --model, --dtypes, "
                                        "--batch-sizes, --distinct, --prompt-len, --new-tokens, --chart PATH.")
    b.set_defaults(func=bench)
    r = commands.add_parser("prepare", help="build the CPU kernels and prepare the embedded default model ahead of "
                                           "a first start (make does it with the venv)")
    r.add_argument("--skip-model", action="store_true", help="the kernels only")
    r.set_defaults(func=prepare)
    k = commands.add_parser("tenant-key", help="a new random API key for a tenant, and the tenants-file line that "
                                               "gives it (only its SHA-256 goes in the file)")
    k.add_argument("name", help="the tenant's name, as in [tenants.NAME]")
    k.set_defaults(func=tenant_key)
    rb = commands.add_parser("run-batch", help="answer an OpenAI batch file (JSONL) with a server started for it",
                             allow_abbrev=False,
                             description="Every argument but these is `loramux serve`'s (the model, --lora-modules, "
                                         "limits): a server of those flags answers the file, then stops. Lines already "
                                         "in the output file are not run again (a stopped run resumes).")
    rb.add_argument("-i", "--input-file", required=True, help="OpenAI batch input: {custom_id, method, url, body} lines")
    rb.add_argument("-o", "--output-file", required=True, help="answers are appended here, one line each")
    rb.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    rb.set_defaults(func=run_batch)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("bench", "run-batch"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.args = extra
    args.func(args)


if __name__ == "__main__":
    main()
