"""vLLM's side of vs_vllm.py, run by the Python of a venv that has vLLM (it imports vllm; loramux never does).

Reads a JSON job on stdin: {"model", "dtype", "max_loras", "max_rank", "max_num_seqs", "max_model_len",
"prompts": [[token ids]], "new_tokens", "cases": {case: [adapter name or null per prompt]}, "adapters": {name:
path}, "repeats", "eager"}; one LoRA-enabled engine runs every case `repeats` times (after one warm-up run of
the first case) and the last line printed is {"tok_s": {case: [output tok/s per run]}}.
"""
from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=job["model"], dtype=job["dtype"], enable_lora=True, max_loras=job["max_loras"],
              max_lora_rank=job["max_rank"], max_num_seqs=job["max_num_seqs"], max_model_len=job["max_model_len"],
              enforce_eager=job["eager"], seed=0)
    ids = {name: i + 1 for i, name in enumerate(job["adapters"])}
    requests = {name: LoRARequest(name, ids[name], path) for name, path in job["adapters"].items()}
    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def run(case: str) -> float:
        loras = [None if a is None else requests[a] for a in job["cases"][case]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    run(next(iter(job["cases"])))  # warm-up: compiles, allocates, loads
    tok_s = {case: [] for case in job["cases"]}
    for _ in range(job["repeats"]):
        for case in job["cases"]:  # interleaved, as the loramux side runs them
            tok_s[case].append(run(case))
    print(json.dumps({"tok_s": tok_s}))


if __name__ == "__main__":
    main()
