"""Several LoRA adapters served by one engine, driven step by step (vLLM's multilora_inference example, on
loramux): the embedded default model (SmolLM2-135M-Instruct) with the demo adapters in examples/adapters, and
`max_loras=1`, so the adapters take turns in the one device slot while base-model requests run beside any of
them. Each request has its own sampling parameters: greedy, greedy with logprobs, seeded sampling, a stop string.
Every finished request prints the step it finished at, its adapter, why it finished, and its text.

    .venv/bin/python examples/multilora_inference.py
"""
from __future__ import annotations

import os

from loramux import EngineConfig, LoRAConfig, SamplingParams
from loramux.engine.llm_engine import LLMEngine

ADAPTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adapters")


def test_prompts() -> list[tuple[str, SamplingParams, str | None]]:
    """(prompt, its sampling parameters, its adapter or None for the base model)."""
    greedy = SamplingParams(max_tokens=24, temperature=0)
    return [
        ("Tell me about the sea.", greedy, None),
        ("Tell me about the sea.", SamplingParams(max_tokens=24, temperature=0, logprobs=1), "pirate"),
        ("Tell me about bread.", SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7), "pirate"),
        ("Tell me about bread.", greedy, "french"),
        ("What is the capital of France?", greedy, "json"),
        ("What is the capital of France?", SamplingParams(max_tokens=24, temperature=0, stop=["."]), "french"),
    ]


def make_engine() -> LLMEngine:
    """max_loras=1: one adapter in a device slot at a time (requests of the others wait for their turn);
    max_cpu_loras=2: two adapters in host memory, the third read back from disk when its turn comes."""
    lora = LoRAConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=16)
    engine = LLMEngine(EngineConfig(model=None, lora=lora, max_num_seqs=16))
    for name in ("pirate", "french", "json"):
        result = engine.load_adapter(name, os.path.join(ADAPTERS, name))
        assert result, result.message
    return engine


def process_requests(engine: LLMEngine, requests: list[tuple[str, SamplingParams, str | None]]) -> None:
    """Add the requests, then step until every one has finished, printing each as it does."""
    for prompt, params, adapter in requests:  # as a chat: the adapters were trained on the chat template
        engine.add_request(engine.chat_ids([{"role": "user", "content": prompt}]), params, adapter)
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step(finished_only=True):
            logprob = f", first token's logprob {float(output.logprobs.logprobs[0]):.3f}" if output.logprobs else ""
            print(f"step {step:3d}  {output.adapter or 'base':<7} {output.finish_reason:<6}{logprob}\n"
                  f"          {output.text.strip()!r}")


def main() -> None:
    engine = make_engine()
    process_requests(engine, test_prompts())


if __name__ == "__main__":
    main()
