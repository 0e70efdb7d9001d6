"""`loramux serve --lora-modules` with an adapter that has embedding and output-head LoRA, the target modules left
at their default: the engine wraps what the adapter needs, says so in the log, and serves it as offline."""
import httpx

from conftest import save_distinct_adapter, tiny_llama
from loramux import LLM, LoRAConfig, SamplingParams
from support.serving import make_files, server_log, start_server, stop


def test_an_adapter_given_at_start_gets_its_embedding_and_head_wrapped(tmp_path_factory):
    files = make_files(tmp_path_factory)
    emb = save_distinct_adapter(tiny_llama(), files["root"] / "emb", 1, r=4,
                                target_modules=["embed_tokens", "lm_head", "q_proj"])
    files = {**files, "served": {"emb": emb}}
    proc, url = start_server(files, "--log-level", "info")
    try:
        body = {"model": "emb", "prompt": "hello", "max_tokens": 6, "temperature": 0}
        served = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert "wrapped embed_tokens, lm_head for the start-up adapters" in server_log(proc)
    finally:
        stop(proc)
    offline = LLM(model=files["model"], lora=LoRAConfig(max_loras=4, max_lora_rank=32), dtype="float32",
                  kv_cache_memory=2**23, adapters={"emb": emb})
    expected = offline.generate("hello", SamplingParams(max_tokens=6, temperature=0), adapters="emb")[0].text
    assert served == expected
