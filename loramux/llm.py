"""LLM: the offline API. `LLM(model=path).generate(prompts, SamplingParams(...), adapters=[...])`."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from tqdm.auto import tqdm

from loramux.adapters.names import parse_adapter_arg
from loramux.adapters.status import LoRAResult
from loramux.config import EngineConfig, LoRAConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.output import RequestOutput
from loramux.sampling_params import SamplingParams


class AdapterRefusedError(ValueError):
    """An adapter given to LLM(adapters=...) could not be loaded; the message names it and says why."""


def _per_request(value, count: int, what: str) -> list:
    """One value for every request: a single value is repeated, a list must have one per request."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"got {len(value)} {what} for {count} prompts")
        return list(value)
    return [value] * count


class LLM:
    def __init__(self, model: str | None = None, lora: LoRAConfig | None = LoRAConfig(), dtype: str = "auto",
                 max_num_seqs: int = 64, adapters: Mapping[str, str] | Sequence[str] = (), **engine_kwargs):
        """model: an HF directory, a .gguf file, or None for the embedded SmolLM2-135M-Instruct.
        adapters: loaded at construction, {name: path} or ["name=path", ...]; whatever of embed_tokens, lm_head
        and the MoE experts they have LoRA on is wrapped too (EngineConfig.startup_adapters). A refused one
        raises AdapterRefusedError (a ValueError) with the reason.
        engine_kwargs: any other EngineConfig field (max_model_len, kv_cache_memory, device, ...)."""
        specs = [f"{n}={p}" for n, p in adapters.items()] if isinstance(adapters, Mapping) else list(adapters)
        paths = (*engine_kwargs.pop("startup_adapters", ()), *(parse_adapter_arg(spec)[1] for spec in specs))
        config = EngineConfig(model=model, lora=lora, dtype=dtype, max_num_seqs=max_num_seqs, startup_adapters=paths,
                              **engine_kwargs)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        for spec in specs:
            result = self.load_adapter(spec)
            if not result:
                raise AdapterRefusedError(f"adapter {spec!r}: {result.message}")

    def generate(self, prompts: str | Sequence, sampling_params: SamplingParams | Sequence | None = None,
                 adapters: str | Sequence | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists. adapters: one name (or
        None) for all, or one per prompt. Returns the finished outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_request(sampling_params or SamplingParams(), len(prompts), "sampling params")
        names = _per_request(adapters, len(prompts), "adapters")
        ids = [self.engine.add_request(p, sp, a) for p, sp, a in zip(prompts, params, names)]
        finished: dict[str, RequestOutput] = {}
        show = len(ids) >= 8 if use_tqdm is None else use_tqdm
        with tqdm(total=len(ids), desc="generate", disable=not show) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step(finished_only=True):
                    finished[output.request_id] = output
                    bar.update(1)
        return [finished[i] for i in ids]

    def embed(self, prompts: str | Sequence, adapters: str | Sequence | None = None, pooling: str = "last",
              normalize: bool = True, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Each prompt's embedding (`.embedding`): the last layer's hidden states with the prompt's adapter,
        pooled ("last" token, or "mean") and, by default, scaled to unit length. Batched with anything else
        the engine runs; nothing is generated."""
        params = SamplingParams(max_tokens=1, pooling=pooling, normalize=normalize)
        return self.generate(prompts, params, adapters, use_tqdm)

    def chat(self, messages: Sequence, sampling_params=None, adapters=None, use_tqdm=None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, adapters, use_tqdm)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True) -> list[int]:
        """The conversation's token ids through the model's chat template (messages checked first)."""
        return self.engine.chat_ids(conversation, add_generation_prompt)

    # ---- the adapter API: the engine's adapter system itself (LoRAManager), one call away ---------------------
    def load_adapter(self, spec: str, path: str | None = None, **kwargs) -> LoRAResult:
        """"name=path", a bare path, or (name, path); kwargs: allow_pickle, allowed_dirs (LoRAManager)."""
        return self.engine.adapters.load_adapter(spec, path, **kwargs)

    def load_adapter_from_tensors(self, name: str, tensors: dict, peft_config: dict, replace: bool = False) -> LoRAResult:
        """An adapter pushed from memory, as a trainer holds it: `tensors` named as PEFT saves them
        (`get_peft_model_state_dict(model)`, or adapter_model.safetensors' keys), `peft_config` as
        adapter_config.json holds it (`peft_config.to_dict()`). Checked as files are (dtype, shapes, finite
        values, rank, targets); the weights are copied. replace=True: new weights for a loaded name, in place
        (requests already running finish on the old ones; new requests get these, with a cold prefix cache)."""
        return self.engine.adapters.add_adapter(name, tensors, peft_config, replace)

    def unload_adapter(self, name: str) -> LoRAResult:
        return self.engine.adapters.unload_adapter(name)

    def pin_adapter(self, name: str) -> LoRAResult:
        return self.engine.adapters.pin_adapter(name)

    def reset_prefix_cache(self) -> int:
        """vLLM's LLM.reset_prefix_cache: forget every cached prefix block (say, after changing weights outside
        loramux); returns how many were cached."""
        return self.engine.reset_prefix_cache()

    def unpin_adapter(self, name: str) -> LoRAResult:
        return self.engine.adapters.unpin_adapter(name)

    def activate_adapter(self, name: str) -> int:
        return self.engine.adapters.activate_adapter(name)

    def is_lora(self, name: str) -> bool:
        return self.engine.adapters.is_lora(name)

    def is_active_lora(self, name: str) -> bool:
        return self.engine.adapters.is_active_lora(name)

    @property
    def loras(self) -> list[str]:
        return self.engine.adapters.loras
