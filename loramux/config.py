"""Frozen configuration objects. Stdlib only: the scheduler and the server read these too."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

# The seven Llama-family projections PEFT users target most; names as in HF transformers.
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's --speculative-config: each decoding request proposes up to
    num_speculative_tokens next tokens, and one forward pass over them, with the request's own adapter, keeps
    those the model itself would have produced (greedy: token for token; sampled: the same distribution)."""

    method: str | None = None
    """"ngram": prompt lookup, the tokens that followed the last earlier occurrence of the request's last n
    tokens (prompt and output), n from prompt_lookup_max down to prompt_lookup_min. "draft_model": a smaller
    model of the same tokenizer (`model`) proposes greedily. None: "draft_model" when `model` is given, else
    "ngram"."""
    model: str | None = None
    """The draft model (method "draft_model"): an HF directory or a GGUF file with the target's vocabulary; it
    runs without adapters, in the engine's dtype, beside the target in the same KV-cache blocks."""
    num_speculative_tokens: int = 5
    prompt_lookup_max: int | None = None
    """None: prompt_lookup_min, or 5 when neither is given (vLLM's)."""
    prompt_lookup_min: int | None = None
    """None: prompt_lookup_max, or 5 when neither is given."""
    disable_by_batch_size: int | None = None
    """No request proposes while more than this many decode in a step (a full batch gains little from
    speculation). None: the engine's default, 8 on a CPU (where a batch of 8 already fills the cores) and 32 on
    a GPU. Below it, each request proposes only while its own acceptance pays (engine/speculative.py)."""

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('speculative method "draft_model" needs a `model` (the draft), and only it takes one')
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = (5, 5) if low is high is None else (low if low is not None else high, high if high is not None else low)
        _check_positive("prompt_lookup_min", low)
        _check_positive("prompt_lookup_max", high)
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if self.disable_by_batch_size is not None:
            _check_positive("disable_by_batch_size", self.disable_by_batch_size)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From what a user passes: a SpeculativeConfig, a dict or a JSON object (vLLM's spelling); unknown
        keys are refused, naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**value)

SCHEDULING_POLICIES = ("fcfs", "priority")
# A GPU step's default token budget, as vLLM's EngineArgs: usage -> (smaller GPU, >= 70 GiB and not an A100)
GPU_STEP_TOKENS = {"offline": (8192, 16384), "server": (2048, 8192)}
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cache_dir() -> str:
    """loramux's cache directory: $XDG_CACHE_HOME/loramux, or ~/.cache/loramux."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loramux")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters live where, and how large they may be."""

    max_loras: int = 4
    """Device slots: the most distinct adapters one forward pass (one engine step) can use."""
    max_cpu_loras: int | None = None
    """Host tier: adapters kept in host memory (LRU). Evicted ones are reloaded from disk on use. None: 16, or
    max_loras if that is more (as vLLM, which defaults it to max_loras)."""
    max_cpu_lora_bytes: int | None = None
    """Host tier in bytes too (None: by count only): the least recently used adapters leave until the new one
    fits. Sizes differ by orders of magnitude (q/v LoRA against every MoE expert and a saved head)."""
    max_spill_bytes: int = 4 << 30
    """Disk for the host copies of adapters that left host memory, as they were built (adapters/spill.py): one
    that comes back while its files still hold what was loaded is read from there in one read instead of being
    parsed, checked and built again from its files (about a tenth of the CPU). Least recently read leave first; 0 = off
    (every read-back reads the adapter's own files)."""
    spill_dir: str | None = None
    """Where that disk is: an anonymous file (gone with the process) is made in this directory. None: loramux's
    cache directory ($XDG_CACHE_HOME/loramux/spill, or ~/.cache/loramux/spill). Put it on a disk: on a tmpfs
    the copies stay in memory."""
    max_lora_rank: int = 64
    """Slot buffers are padded to this rank; adapters of higher rank are refused at load."""
    target_modules: tuple[str, ...] | None = None
    """Module-name suffixes to wrap with LoRA layers; None = DEFAULT_TARGET_MODULES. "embed_tokens" and "lm_head"
    add embedding / output-head LoRA (and, with max_module_copies_bytes, modules_to_save copies of them)."""
    allow_pickle: bool = False
    """Read `adapter_model.bin` (with torch.load(weights_only=True)); off by default."""
    max_module_copies_bytes: int = 0
    """Bytes all loaded adapters' whole module copies (PEFT modules_to_save of embed_tokens / lm_head: one full
    table each) may take together; 0 = such adapters are refused. The modules must be in target_modules."""
    lora_dtype: str = "auto"
    """The linear layers' LoRA A/B in their slots (vLLM's lora_dtype): "auto" = the activations' dtype (exact);
    "bfloat16" on a float32 model (a GGUF's default) halves the adapter bytes each decode step reads, and with
    them most of an adapter's cost at batch 1; the math stays fp32 on the bf16-rounded weights. "float16" is the
    same on CUDA (float16 weights under float32 or float16 activations); on CPU, which has no fast float16, it runs
    as bfloat16 with a warning, as the model's dtype does. Embedding and expert LoRA keep the activations'
    dtype."""

    keep_revisions: int = 1
    """Revisions of a name kept addressable (`name@rev`): 1 = only the current one. With N > 1, a reload in place
    keeps the N - 1 loads before it (in host memory as any adapter, LRU, counted against the host tier; read
    back from their files if evicted), so rollouts still running or replayed on an older revision can address
    it; an unload removes them all. A load whose files changed on disk is not kept (its files are gone)."""

    load_timeout_s: float = 60.0
    """A pinned load (or a pinned adapter's reload in place) needs host memory and a device slot now: while
    requests in use hold them it waits, this long at most, then fails saying so. Unpinned loads never wait:
    they are registered at once and read into host memory when their requests need it."""

    def __post_init__(self) -> None:
        _check_positive("max_loras", self.max_loras)
        _check_positive("keep_revisions", self.keep_revisions)
        if not isinstance(self.load_timeout_s, (int, float)) or not self.load_timeout_s > 0:
            raise ValueError(f"load_timeout_s must be a number of seconds > 0, got {self.load_timeout_s!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", max(16, self.max_loras))
        _check_positive("max_cpu_loras", self.max_cpu_loras)
        _check_positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_lora_bytes is not None:
            _check_positive("max_cpu_lora_bytes", self.max_cpu_lora_bytes)
        if not isinstance(self.max_spill_bytes, int) or self.max_spill_bytes < 0:
            raise ValueError(f"max_spill_bytes must be an integer >= 0, got {self.max_spill_bytes!r}")
        if not isinstance(self.max_module_copies_bytes, int) or self.max_module_copies_bytes < 0:
            raise ValueError(f"max_module_copies_bytes must be an integer >= 0, got {self.max_module_copies_bytes!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}; got {self.lora_dtype!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "every adapter in a device slot is also kept in host memory"
            )
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
            if not self.target_modules:
                raise ValueError("target_modules must name at least one module, or be None")

    @property
    def targets(self) -> tuple[str, ...]:
        return self.target_modules or DEFAULT_TARGET_MODULES

    @property
    def spill_directory(self) -> str:
        return self.spill_dir or os.path.join(cache_dir(), "spill")


@dataclass(frozen=True)
class GrammarLimits:
    """What a structured output (JSON schema, regex, choice list, Lark / GBNF grammar) may be. A request past
    a limit gets an error naming it; an operator raises them (loramux serve --max-grammar-*)."""

    max_bytes: int = 512 * 1024
    """Its text: the schema, the regex, the grammar, or the choices together."""
    max_choices: int = 10_000
    """Items of a choice list (each one a string of the output's possible values)."""
    max_rules: int = 1_000
    """Rules of a Lark or GBNF grammar (the grammar engine recurses along chains of rules)."""
    max_alternatives: int = 2_000
    """Alternatives of one grammar rule (the grammar engine's row limit; literals in a terminal, NAME: "a" |
    "b", or a choice list, have none)."""
    max_nesting: int = 64
    """Nesting depth of a JSON schema's objects and arrays."""
    check_timeout_s: float = 10.0
    """The server checks and compiles each new structured output in a worker process; one that takes longer
    is refused (and the worker replaced)."""
    check_memory_bytes: int = 2 << 30
    """Address space of that worker process; a check that needs more is refused."""
    cache_bytes: int = 16 << 20
    """The engine's compiled grammars are cached by grammar text up to this many bytes of text (a compiled
    matcher takes ~5-15x its text)."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "max_rules", "max_alternatives", "max_nesting",
                     "check_memory_bytes", "cache_bytes"):
            _check_positive(name, getattr(self, name))
        if not self.check_timeout_s > 0:
            raise ValueError(f"check_timeout_s must be positive, got {self.check_timeout_s!r}")


_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """The engine: model, memory and batching limits. Fields are validated at construction."""

    model: str | None = None
    """An HF model directory (config.json + safetensors), a .gguf file, or None for the embedded default."""
    dtype: str = "auto"
    """"auto" = the checkpoint's dtype (float32 for GGUF); or float32 / bfloat16 / float16."""
    device: str = "auto"
    """"auto" = cuda when available, else cpu."""
    lora: LoRAConfig | None = LoRAConfig()
    """Adapter limits; None serves the base model only."""
    startup_adapters: tuple[str, ...] = ()
    """Paths of the adapters loaded at start (the server's --lora-modules, LLM(adapters=...)): whatever of
    embed_tokens, lm_head and the MoE experts they have LoRA on is wrapped too, beyond lora.target_modules
    (adapters loaded later that need an unwrapped module are refused, saying which)."""
    lora_backend: str = "auto"
    """LoRA op backend (loramux.ops.BACKENDS); "auto" picks the fastest for the device."""
    attention_backend: str = "auto"
    """Decode-attention and KV-store ops (loramux.ops.ATTENTION_BACKENDS, KV_STORE_BACKENDS); "auto" picks the
    fastest for the device."""
    pointwise_backend: str = "auto"
    """RMSNorm (+ residual add) / SiLU-and-mul / rotary / greedy argmax ops (loramux.ops.POINTWISE_BACKENDS);
    "auto" = the fastest for the device."""
    moe_backend: str = "auto"
    """Fused-experts op of mixture-of-experts models (loramux.ops.MOE_BACKENDS); "auto" = the C++ kernel where
    it runs."""
    quantization: str | None = None
    """Weight-only quantization of the base model's linear layers (adapters stay in `dtype`). None = as the
    checkpoint is: a GGUF keeps its quantized tensors (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k; other types are
    dequantized with a warning), a GPTQ / AWQ int4 checkpoint stays int4, a bitsandbytes 4-bit one (QLoRA's
    NF4 / FP4) stays 4-bit, a plain one stays in `dtype`. "none" = everything dequantized to `dtype`. "int8"
    (per output channel) / "int4" (groups of quantization_group_size inputs) / "bitsandbytes" (vLLM's
    spelling: NF4 in blocks of 64, as bitsandbytes' load_in_4bit): a plain checkpoint quantized at load,
    round to nearest (a quantized one is dequantized first); the output head stays in `dtype`."""
    quantization_group_size: int = 128
    """Inputs per scale for quantization="int4": 32, 64 or 128."""
    quant_backend: str = "auto"
    """Quantized-matmul op (loramux.ops.QUANT_BACKENDS); "auto" = the C++ kernel where it runs (x86 with AVX2)."""
    max_num_seqs: int = 64
    """Requests in one decode step at most."""
    max_model_len: int | None = None
    """Prompt + generated tokens per request at most; None = the model's limit, capped at 4096."""
    max_num_batched_tokens: int | None = None
    """The tokens of one step, decode rows and prompt chunks together (chunked prefill); None: 256 on a CPU,
    where a 256-token chunk of a 135M model takes ~0.4 s and a long prompt's prefill is as fast as with 1024
    (benchmarks/README.md); on a GPU vLLM's defaults (GPU_STEP_TOKENS): offline 16384 on a GPU of >= 70 GiB
    (A100s excepted), else 8192; served 8192 / 2048. Without chunked prefill: the prompt tokens of one prefill
    step (None: 4096), raised to max_model_len if lower."""
    usage: str = "offline"
    """Who runs the engine, for the defaults that differ (as vLLM's UsageContext): "offline" (LLM, loramux
    generate: throughput) or "server" (loramux serve: latency too)."""
    num_threads: int | None = None
    """CPU threads for torch and the C++ kernels (torch.set_num_threads at start); None = torch's default
    (one per core, or OMP_NUM_THREADS). Served on a small machine, leaving a core to the HTTP process can
    help: an oversubscribed OpenMP region stalls every kernel of a step."""
    enable_chunked_prefill: bool | None = None
    """As vLLM V1's (on by default; None: on unless batch_invariant): a step runs every decoding request plus
    prompt chunks up to max_num_batched_tokens, shortest prompt first, so a long prompt no longer stalls
    running requests for a whole prefill, and a request aborted mid-prefill stops at the next chunk."""
    enable_prefix_caching: bool | None = None
    """Automatic prefix caching (as vLLM V1; None: on unless batch_invariant): full KV blocks are shared
    between requests of the same adapter identity whose tokens up to them are equal (engine/block_manager.py);
    a request's prefill starts after its cached blocks."""
    prefill_slowdown_cap: float | None = None
    """With chunked prefill, a step takes prompt tokens only up to about this many times the time of a
    decode-only step of the batch about to decode (the running streams, and the requests whose prompts fit in
    a step's budget; the costs learned from the steps run: engine/step_cost.py), so that running streams
    keep their pace and a request that arrives is not held behind long prompts; a long prompt alone is
    prefilled in smaller chunks. A step may still carry twice the prompt tokens of the short prompts (those
    within one step's budget) admitted per step lately, so that a sustained load's prompts keep pace rather
    than park requests in prefill. None (offline): only max_num_batched_tokens bounds a step; loramux serve: 2."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory: int | None = None
    """KV-cache bytes; None = kv_cache_fraction of the memory available at start-up."""
    kv_cache_fraction: float = 0.2
    max_wait_steps: int = 64
    """Age bound: a request skipped this many scheduler steps (its adapter had no slot) is admitted
    next, before anything else."""
    scheduling_policy: str = "fcfs"
    """vLLM's: "fcfs", first come first served (a request's priority must be 0), or "priority": waiting requests
    are admitted by (SamplingParams.priority, arrival), lower first, and when KV memory runs out the running
    request of the highest value is preempted first."""
    seed: int = 0
    """Seed for requests that bring none."""
    grammar_limits: GrammarLimits = GrammarLimits()
    """What a structured output may be (checked where a request enters: HTTP or LLM.generate)."""
    enforce_eager: bool = False
    """As vLLM's: decode steps on a GPU run op by op instead of as CUDA graphs (engine/cuda_graphs.py), which
    are captured at start for batch sizes 1, 2, 4, 8, 16, ... up to max_num_seqs where everything the model
    runs can be captured (the start-up log says why not where it cannot)."""
    batch_invariant: bool = False
    """A request's tokens do not depend on its batch mates, in any dtype (as vLLM's VLLM_BATCH_INVARIANT):
    every GEMM on a fixed row count (the LoRA op's too: torch-fixed-rows), attention per sequence length.
    Without it, bf16 results can change in the last bits with the batch, and greedy tokens then diverge.
    Costs speed: see benchmarks/README.md."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (SpeculativeConfig; a dict or JSON string is parsed); None: off."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "startup_adapters", tuple(self.startup_adapters))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.batch_invariant and self.lora_backend not in ("auto", "torch-fixed-rows"):
            raise ValueError(f"batch_invariant runs the LoRA op 'torch-fixed-rows'; lora_backend={self.lora_backend!r} "
                             "is not batch-invariant")
        if self.enable_chunked_prefill is None:
            object.__setattr__(self, "enable_chunked_prefill", not self.batch_invariant)
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", not self.batch_invariant)
        if self.batch_invariant and self.enable_prefix_caching:
            raise ValueError("batch_invariant computes every prompt whole; it cannot be combined with "
                             "enable_prefix_caching (a cached prefix's K/V came from another request's batch)")
        if self.batch_invariant and self.enable_chunked_prefill:
            raise ValueError("batch_invariant prefills each sequence whole; it cannot be combined with "
                             "enable_chunked_prefill")
        if self.batch_invariant and self.speculative_config is not None:
            raise ValueError("batch_invariant decodes one token per row on a fixed row count; it cannot be combined "
                             "with speculative_config (a verification pass has several tokens per row)")
        if self.batch_invariant and self.attention_backend not in ("auto", "torch"):
            raise ValueError(f"batch_invariant runs attention in torch; attention_backend={self.attention_backend!r} "
                             "is not batch-invariant")
        if self.quantization not in (None, "none", "int8", "int4", "bitsandbytes"):
            raise ValueError(f"quantization must be None (as the checkpoint is), 'none', 'int8', 'int4' or "
                             f"'bitsandbytes', got {self.quantization!r}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size!r}")
        for name in ("max_num_seqs", "block_size", "max_wait_steps"):
            _check_positive(name, getattr(self, name))
        if self.max_num_batched_tokens is not None:
            _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.usage not in GPU_STEP_TOKENS:
            raise ValueError(f"usage must be one of {', '.join(GPU_STEP_TOKENS)}, got {self.usage!r}")
        if self.prefill_slowdown_cap is not None and not self.prefill_slowdown_cap > 1:
            raise ValueError(f"prefill_slowdown_cap must be > 1 or None, got {self.prefill_slowdown_cap!r}")
        if self.num_threads is not None:
            _check_positive("num_threads", self.num_threads)
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None:
            _check_positive("kv_cache_memory", self.kv_cache_memory)
        if not 0 < self.kv_cache_fraction <= 0.9:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.9], got {self.kv_cache_fraction!r}")

    def step_token_budget(self, device: str = "cpu", device_memory: int = 0, device_name: str = "") -> int:
        """max_num_batched_tokens, or its default for a step on `device` ("cpu", "cuda"), a GPU's by its
        memory (bytes) and name."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            return 4096
        if device == "cpu":
            return 256
        large = device_memory >= 70 * 2**30 and "a100" not in device_name.lower()  # vLLM: A100s lose with more
        return GPU_STEP_TOKENS[self.usage][large]


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end. The engine's own limits live in EngineConfig."""

    host: str = "127.0.0.1"
    port: int = 8000
    listen_fd: int | None = None
    """An inherited, already listening socket (its file descriptor) to serve on instead of binding host:port,
    as a parent that opened it passes it on (run-batch; a process manager's socket activation): no other
    process can take the port between the parent's choice and the server's start."""
    served_model_name: str | None = None
    """The name clients use for the base model; None = the model path's last component."""
    api_key: str | None = None
    """When set, every endpoint but /health needs `Authorization: Bearer <api_key>`."""
    public_metrics: bool = False
    """/metrics answered without a key, as /health is (for scrapers such as an inference gateway's endpoint picker,
    which send none); it names every tenant's adapters, so off by default when keys or tenants are set."""
    tenants_file: str | None = None
    """A TOML file of tenants (server/http/tenants.py): their keys, the adapter names each may use and change, their
    limits and shares; reloaded on SIGHUP. None: no tenants (the API key, if any, opens everything)."""
    allowed_adapter_dirs: tuple[str, ...] = ()
    """Runtime loads (/v1/load_lora_adapter) only from under these directories; none = runtime loads off."""
    allowed_adapter_uris: tuple[str, ...] = ()
    """Runtime loads from these URI prefixes too (s3://bucket/dir, gs://, https://host/path, hf://org): fetched
    into a local cache (adapters/remote.py); none = loads from URIs off."""
    max_adapter_download_bytes: int = 1 << 30
    """A remote adapter's two files together at most this many bytes."""
    adapter_download_timeout: float = 300.0
    """Seconds a remote adapter's fetch may take, at most."""
    max_adapter_upload_bytes: int = 0
    """An adapter's files sent in the body of /v1/load_lora_adapter (multipart: adapter_config.json and
    adapter_model.safetensors) up to this many bytes; 0 = uploads off."""
    lora_resolver_dirs: tuple[str, ...] = ()
    """A `model` that names no registered adapter is loaded from DIR/<model> on its first request, if there."""
    lora_resolver_uris: tuple[str, ...] = ()
    """... or from PREFIX/<model>/ in a store (s3://, gs://, http(s)://, hf://), fetched as allowed_adapter_uris are."""
    lora_resolver_hf: bool = False
    """... or from the local Hugging Face cache (a Hub id, org/name; downloaded first unless HF_HUB_OFFLINE)."""
    lora_resolvers: tuple[str, ...] = ()
    """... or by these resolver plugins, `module:attribute` (loramux.adapters.resolvers)."""
    lora_resolver_plugins: bool = True
    """... and by those installed packages declare (entry-point group loramux.lora_resolvers)."""
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_stop: int = 4
    max_prompts_per_request: int = 64
    """Engine requests one HTTP request may start (prompts x n); more is a 400."""
    max_pending_requests: int = 256
    """Engine requests in flight (running or queued) at most; a request past it gets 429 with Retry-After."""
    max_pending_tokens: int = 1 << 20
    """Prompt tokens + max_tokens of the requests in flight, at most (429 past it)."""
    max_pending_per_client: int = 0
    """Requests in flight per client (its API key, else its address); 0 = no per-client limit."""
    max_resolves_per_client: int = 8
    """Cold adapter names one client (its API key, else its address) has resolving at once; its others wait
    their turn. The resolver threads are shared: one client asking for hundreds of unknown names must not hold
    them all while another's cold adapter waits. 0 = no limit."""
    max_connections: int = 0
    """Open connections at most (0: the file limit less a margin); past it the oldest one waiting for a request
    head is closed (server/http/connections.py)."""
    max_connections_per_client: int = 1024
    """Open connections per client address at most; past it that client's oldest idle one is closed."""
    header_timeout: float = 30.0
    """A connection whose request head is not complete this many seconds after it opened (or after its last
    response) is closed."""
    shutdown_timeout: float = 30.0
    """On SIGTERM, running requests get this long to finish; then they end with an error and the server exits."""
    engine_start_timeout: float = 600.0
    engine_unresponsive_s: float = 5.0
    """No engine heartbeat for this long: /health answers 503."""
    engine_kill_s: float = 30.0
    """No engine heartbeat for this long: the engine is frozen; it is killed and restarted."""
    tool_call_parser: str | None = None
    """How tool calls are read from a model's text for tool_choice "auto" (server.tools.TOOL_CALL_PARSERS);
    None: "auto" is refused ("required" and named functions work without one)."""

    def __post_init__(self) -> None:
        for name in ("allowed_adapter_dirs", "lora_resolver_dirs", "lora_resolvers", "allowed_adapter_uris",
                     "lora_resolver_uris"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("max_body_bytes", "max_n", "max_stop", "max_prompts_per_request", "max_pending_requests",
                     "max_pending_tokens", "max_adapter_download_bytes"):
            _check_positive(name, getattr(self, name))
        for name in ("max_resolves_per_client", "max_connections", "max_pending_per_client",  # 0: no limit
                     "max_adapter_upload_bytes"):  # (0: off)
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        _check_positive("max_connections_per_client", self.max_connections_per_client)
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout must be > 0 seconds, got {self.header_timeout!r}")
        for name in ("shutdown_timeout", "engine_start_timeout", "engine_unresponsive_s", "engine_kill_s",
                     "adapter_download_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.engine_kill_s <= self.engine_unresponsive_s:
            raise ValueError("engine_kill_s must be longer than engine_unresponsive_s")
        if self.tool_call_parser not in (None, "hermes"):  # server.tools.TOOL_CALL_PARSERS (config has no imports)
            raise ValueError(f"tool_call_parser must be one of: hermes; got {self.tool_call_parser!r}")
