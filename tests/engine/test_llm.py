"""The offline LLM against HF transformers + PEFT: same greedy tokens for every row of a mixed batch."""
import pytest
import torch

from conftest import MODEL_FACTORIES, hf_greedy, save_checkpoint, save_peft_adapter
from loramux import LoRAConfig, LoRAStatus
from loramux.engine.model_runner import batch_order
from loramux.llm import LLM
from loramux.ops import BACKENDS, wants_grouped_tokens
from loramux.sampling_params import SamplingParams

ADAPTERS = ("r4", "r8_rslora", "r16_patterns", "r64_qv")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import TINY

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32)).eval()


FACTORIES = {**MODEL_FACTORIES, "qwen3": qwen3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (base model, checkpoint dir, {adapter kind: adapter dir})}."""
    from conftest import ADAPTER_KINDS

    out = {}
    for kind, factory in FACTORIES.items():
        base, root = factory(), tmp_path_factory.mktemp(kind)
        adapters = {a: save_peft_adapter(base, root / a, seed=200 + i, **ADAPTER_KINDS[a]) for i, a in enumerate(ADAPTERS)}
        out[kind] = (base, save_checkpoint(base, root / "model"), adapters)
    return out


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(2, 14, (1,), generator=gen)),), generator=gen).tolist() for _ in range(n)]


def record_preemptions(scheduler) -> list:
    """The sequences `scheduler` preempts from now on (its schedule() is wrapped)."""
    preempted, schedule = [], scheduler.schedule

    def spy(*args):
        scheduled = schedule(*args)
        preempted.extend(scheduled.preempted)
        return scheduled

    scheduler.schedule = spy
    return preempted


def make_llm(path, adapters=None, **kw):
    llm = LLM(model=path, lora=kw.pop("lora", LoRAConfig(max_loras=4, max_lora_rank=64)), dtype="float32",
              kv_cache_memory=kw.pop("kv_cache_memory", 2**23), **kw)
    for name, adapter_dir in (adapters or {}).items():
        assert llm.load_adapter(f"{name}={adapter_dir}")
    return llm


def _triton_param():
    from loramux.ops import lora_triton

    return pytest.param("llama", "triton", marks=pytest.mark.skipif(not lora_triton.available("cpu"),
                                                                    reason="needs triton (run in its interpreter)"))


@pytest.mark.parametrize("kind, backend", [(kind, "auto") for kind in FACTORIES] + [("llama", "torch"), _triton_param()])
def test_mixed_batch_greedy_equals_hf_peft_alone(kind, backend, checkpoints):
    """"auto" is the C++ kernel where it runs (rows kept in batch order); "torch" the segmented op (rows
    regrouped by slot for each step); "triton" the GPU kernels (LoRA and paged decode attention), here in
    Triton's interpreter."""
    base, path, adapters = checkpoints[kind]
    extra = {"attention_backend": "triton"} if backend == "triton" else {}
    llm = make_llm(path, adapters, lora_backend=backend, **extra)
    if backend == "triton":
        from loramux.layers.attention import Attention
        from loramux.ops import attention_triton

        ops = {m.decode_op for m in llm.engine.core.runner.model.modules() if isinstance(m, Attention)}
        assert ops == {attention_triton.decode_attention_triton}
    rows = ["r4", None, "r8_rslora", "r16_patterns", "r64_qv", None, "r4", "r64_qv", "r16_patterns", "r8_rslora"]
    batch = prompts(len(rows))
    outputs = llm.generate(batch, GREEDY, adapters=rows)
    for prompt, adapter, out in zip(batch, rows, outputs):
        expected = hf_greedy(base, adapters.get(adapter), prompt, GREEDY.max_tokens)
        assert out.token_ids == expected, f"{adapter}: {out.token_ids} != {expected}"
        assert out.finish_reason == "length" and out.adapter == adapter
    assert len({tuple(o.token_ids) for o in outputs}) > 5  # adapters really changed the outputs


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("attention_backend, rows", [("auto", None), ("auto", False), ("torch", True)])
def test_prompts_attend_as_decode_rows_or_through_sdpa_alike(checkpoints, attention_backend, rows, chunked):
    """Where the C++ decode kernel runs, a step's prompt tokens attend as rows of it (None: the runner's own
    choice); forced off they go through SDPA (whole prompts padded into one call, chunks one call each), and
    forced on under the torch reference op they are rows of that one. Every row equals HF + PEFT alone."""
    from loramux.ops import attention_cpu

    base, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters, attention_backend=attention_backend, enable_chunked_prefill=chunked,
                   max_num_batched_tokens=24 if chunked else None)
    runner = llm.engine.core.runner
    if rows is None:
        assert runner.rows_attention == attention_cpu.available()
    runner.rows_attention = runner.rows_attention if rows is None else rows
    rows_of = ["r4", None, "r8_rslora", "r64_qv", "r16_patterns", "r4"]
    batch = prompts(len(rows_of))
    for prompt, adapter, out in zip(batch, rows_of, llm.generate(batch, GREEDY, adapters=rows_of)):
        assert out.token_ids == hf_greedy(base, adapters.get(adapter), prompt, GREEDY.max_tokens), adapter
    alone = llm.generate(batch[2:3], GREEDY, adapters=rows_of[2:3])[0]  # one sequence's rows share its table
    assert alone.token_ids == hf_greedy(base, adapters["r8_rslora"], batch[2], GREEDY.max_tokens)


def test_bf16_lora_weights_under_fp32_activations_are_fp32_math_on_the_rounded_weights(checkpoints, tmp_path):
    """lora_dtype="bfloat16" on an fp32 model: slots hold A and B in bf16, the math stays fp32. An adapter whose
    weights are bf16 numbers (scaling a power of two, so B * scaling is one too) therefore gives exactly the
    tokens of HF + PEFT in fp32, mixed with base rows and another adapter (rounded, unchecked) in one batch."""
    from safetensors.torch import load_file, save_file

    from loramux.layers.lora import LoRALinear

    base, path, adapters = checkpoints["llama"]
    rounded = save_peft_adapter(base, tmp_path / "bf16", seed=7, r=8, lora_alpha=16)
    weights = load_file(f"{rounded}/adapter_model.safetensors")
    save_file({k: v.bfloat16().float() for k, v in weights.items()}, f"{rounded}/adapter_model.safetensors")
    llm = make_llm(path, {"bf16": rounded, "r4": adapters["r4"]},
                   lora=LoRAConfig(max_loras=2, max_lora_rank=64, lora_dtype="bfloat16"))
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, LoRALinear)]
    assert layers and all(m.lora_a.dtype == m.lora_b.dtype == torch.bfloat16 for m in layers)
    assert all(m.direct_call for m in layers)  # inside the engine's DirectCall modules: no hook dispatch
    rows = ["bf16", None, "bf16", "r4"]
    batch = prompts(len(rows), seed=5)
    outputs = llm.generate(batch, GREEDY, adapters=rows)
    for prompt, adapter, out in zip(batch[:3], rows, outputs):
        assert out.token_ids == hf_greedy(base, {"bf16": rounded}.get(adapter), prompt, GREEDY.max_tokens)
    with pytest.raises(ValueError, match="lora_dtype"):
        LoRAConfig(lora_dtype="float8")
    with pytest.raises(ValueError, match="only 16-bit LoRA weights under float32"):
        LLM(model=path, lora=LoRAConfig(max_loras=1, max_lora_rank=8, lora_dtype="float32"), dtype="bfloat16",
            kv_cache_memory=2**22)


def test_float16_lora_weights_run_as_bfloat16_on_cpu_with_a_warning(checkpoints, caplog):
    from loramux.layers.lora import LoRALinear

    _, path, adapters = checkpoints["llama"]
    with caplog.at_level("WARNING"):
        llm = make_llm(path, {"r4": adapters["r4"]}, lora=LoRAConfig(max_loras=1, max_lora_rank=8, lora_dtype="float16"))
    assert "lora_dtype float16 is not supported on CPU" in caplog.text
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, LoRALinear)]
    assert layers and all(m.lora_a.dtype == torch.bfloat16 for m in layers)
    assert llm.generate(prompts(1, seed=1), GREEDY, adapters="r4")[0].token_ids


def test_rows_keep_their_order_unless_the_lora_op_wants_them_grouped():
    slots = [2, -1, 0, 2, -1]
    assert batch_order(slots, grouped=False) == [0, 1, 2, 3, 4]
    assert batch_order(slots, grouped=True) == [1, 4, 2, 0, 3]  # stable within a slot
    assert wants_grouped_tokens(BACKENDS["torch"])
    assert not wants_grouped_tokens(BACKENDS["cpu"]) and not wants_grouped_tokens(BACKENDS["torch-gathered"])


def test_base_model_without_lora_equals_hf(checkpoints):
    base, path, _ = checkpoints["llama"]
    llm = make_llm(path, lora=None)
    batch = prompts(4, seed=1)
    for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
        assert out.token_ids == hf_greedy(base, None, prompt, GREEDY.max_tokens)
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.generate(batch[0], GREEDY, adapters="r4")


def test_outputs_do_not_depend_on_batch_mates(checkpoints):
    _, path, adapters = checkpoints["qwen2"]
    llm = make_llm(path, adapters)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    target = prompts(1, seed=3)[0]
    alone = [llm.generate(target, p, adapters="r16_patterns")[0].token_ids for p in (GREEDY, seeded)]
    mates = prompts(6, seed=4)
    for params, expected in zip((GREEDY, seeded), alone):
        batch = mates[:3] + [target] + mates[3:]
        names = ["r4", None, "r64_qv", "r16_patterns", "r8_rslora", "r4", None]
        mate_params = [SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)] * 7
        mate_params[3] = params
        assert llm.generate(batch, mate_params, adapters=names)[3].token_ids == expected


def test_preemption_and_slot_pressure_keep_outputs_exact(checkpoints):
    base, path, adapters = checkpoints["llama"]
    # 2 slots for 4 adapters, and a KV cache of a few blocks: requests wait for slots and get preempted.
    llm = make_llm(path, adapters, lora=LoRAConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=64),
                   kv_cache_memory=6 * 2 * 2 * 16 * 2 * 16 * 4, max_model_len=64, block_size=16)
    assert llm.engine.runner.num_blocks == 6
    rows = ["r4", "r8_rslora", "r16_patterns", "r64_qv", None, "r4", "r64_qv", None]
    batch = prompts(len(rows), seed=5)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    preemptions = record_preemptions(llm.engine.scheduler)
    outputs = llm.generate(batch, params, adapters=rows)
    assert preemptions, "the tiny KV cache should have forced a preemption"
    for prompt, adapter, out in zip(batch, rows, outputs):
        assert out.token_ids == hf_greedy(base, adapters.get(adapter), prompt, 20)


def test_stops_lengths_and_streaming(checkpoints):
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters)
    prompt = prompts(1, seed=6)[0]
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), adapters="r4")[0]
    text, ids = free.text, free.token_ids
    stop_word = text[4:6]
    cut = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop=[stop_word], ignore_eos=True),
                       adapters="r4")[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop_word)]
    by_id = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[ids[3]],
                                                ignore_eos=True), adapters="r4")[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == ids[: ids.index(ids[3]) + 1]
    pieces = list(llm.engine.stream([prompt], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)], ["r4"]))
    assert "".join(p.delta_text for p in pieces) == text and pieces[-1].finished
    assert sum(len(p.delta_token_ids) for p in pieces) == 12


def test_eos_stops_unless_ignored(checkpoints):
    _, path, _ = checkpoints["qwen2"]
    llm = make_llm(path)
    free = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    llm.engine.core.eos_token_ids = {free[2]}  # pretend the third greedy token is the model's eos
    stopped = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[: free.index(free[2]) + 1]
    forced = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert forced.finish_reason == "length" and forced.token_ids == free


def test_bad_requests_are_refused_with_the_cause(checkpoints):
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"r4": adapters["r4"]}, max_model_len=32)
    with pytest.raises(ValueError, match="unknown adapter 'ghost'; loaded adapters: r4"):
        llm.generate("hi", GREEDY, adapters="ghost")
    with pytest.raises(ValueError, match="40 tokens; this model.s maximum context length is 32"):
        llm.generate([5] * 40, GREEDY)
    with pytest.raises(ValueError, match="2 adapters for 3 prompts"):
        llm.generate(["a", "b", "c"], GREEDY, adapters=["r4", None])
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    out = llm.generate("x" * 28, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 28


def test_chat_uses_the_template(checkpoints):
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"r4": adapters["r4"]})
    llm.tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}>"
    out = llm.chat([{"role": "user", "content": "hello"}], GREEDY, adapters="r4")[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("<user>hello>") and len(out.token_ids) == 8


def test_kv_budget_too_small_is_refused(checkpoints):
    _, path, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match="fewer than one max_model_len=64 sequence needs"):
        make_llm(path, kv_cache_memory=1024, max_model_len=64)


def test_a_request_whose_logits_go_non_finite_fails_alone(checkpoints):
    """An adapter that slipped past the load checks (its slot poisoned by hand here) stops its own requests
    with an error; the engine keeps serving and every other row is exact."""
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"r4": adapters["r4"], "bad": adapters["r8_rslora"]})
    inputs = prompts(4)
    alone = [llm.generate(inputs[i], GREEDY, adapters=a)[0].token_ids for i, a in ((0, "r4"), (2, None))]
    slot = llm.activate_adapter("bad")
    for layer, _ in llm.engine.adapters.slots._layers.values():
        layer.lora_b[slot].fill_(float("inf"))
    rows = ["r4", "bad", None, "bad"]
    params = [GREEDY, GREEDY, GREEDY, SamplingParams(max_tokens=8, temperature=0.9, seed=3)]
    outs = llm.generate(inputs, params, adapters=rows)
    assert [o.token_ids for o in outs[::2]] == alone
    for out in outs[1::2]:
        assert out.finish_reason == "error" and "NaN or Inf" in out.error and out.token_ids == []
    assert not llm.engine.has_unfinished_requests()


def test_a_step_that_raises_fails_only_the_request_that_makes_it_raise(checkpoints, monkeypatch):
    _, path, adapters = checkpoints["llama"]
    llm = make_llm(path, {"r4": adapters["r4"]})
    alone = [llm.generate(p, GREEDY, adapters="r4")[0].token_ids for p in prompts(3)]
    runner, real_run = llm.engine.runner, llm.engine.runner.run

    def run(seqs, slots, is_prefill, spans=None):  # the second prompt's request breaks every step it is in
        if any(s.token_ids[: s.num_prompt_tokens] == prompts(3)[1] for s in seqs):
            raise RuntimeError("boom")
        return real_run(seqs, slots, is_prefill, spans)

    monkeypatch.setattr(runner, "run", run)
    outs = llm.generate(prompts(3), GREEDY, adapters="r4")
    assert [outs[0].token_ids, outs[2].token_ids] == [alone[0], alone[2]]
    assert outs[1].finish_reason == "error" and "RuntimeError: boom" in outs[1].error


def test_reload_in_place_keeps_running_requests_on_the_old_weights_and_gives_new_ones_the_new(checkpoints):
    """vLLM's load_inplace, without a mix: a request that started before the reload (even one preempted and
    resumed after it) finishes on the old version; one that starts after gets the new. The old version is
    removed once nothing uses it."""
    base, path, adapters = checkpoints["llama"]
    old, new = adapters["r4"], adapters["r8_rslora"]
    llm = make_llm(path, {"swap": old}, lora=LoRAConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=64),
                   kv_cache_memory=6 * 2 * 2 * 16 * 2 * 16 * 4, max_model_len=64, block_size=16)
    engine = llm.engine
    batch = prompts(8, seed=9)  # 6 KV blocks: 6 start, 2 wait
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params, "swap") for p in batch]
    finished = {}
    for _ in range(3):  # some requests are running now, the rest wait for KV blocks
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    started = {i for i in ids if engine.core.sequence(i) and engine.core.sequence(i).adapter_ref is not None}
    first = engine.adapters.identity_for("swap")
    assert 0 < len(started) < len(ids)
    assert llm.load_adapter("swap", new, replace=True) == LoRAStatus.SUCCESS
    late = [engine.add_request(p, params, "swap") for p in batch[:2]]
    preempted = record_preemptions(engine.scheduler)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert any(s.request_id in started for s in preempted), "a request that started on the old weights was preempted"
    for request_id, prompt in zip(ids + late, batch + batch[:2]):
        weights = old if request_id in started else new
        assert finished[request_id].token_ids == hf_greedy(base, weights, prompt, 20), request_id
    adapters_ = engine.adapters
    assert adapters_.store.retiring == set() and adapters_.loras == ["swap"] and len(adapters_.cache) == 1
    assert first not in adapters_.store and adapters_.identity_for("swap") != first  # the first identity is gone


def test_num_threads_sets_the_engines_cpu_threads(checkpoints):
    _, path, _ = checkpoints["llama"]
    before = torch.get_num_threads()
    try:
        make_llm(path, lora=None, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_engine_warms_up_on_slot_0_and_leaves_nothing_behind(checkpoints, monkeypatch, chunked):
    """Before the first request: a prefill and a decode, one row on the base and one on slot 0 (zeros: it adds
    nothing), through the step the engine will run (mixed spans when chunked); the blocks go back."""
    from loramux.engine.model_runner import ModelRunner
    from loramux.layers.lora import LoRALinear

    calls, run = [], ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, seqs, slots, is_prefill, spans=None: (
        calls.append((list(slots), is_prefill, spans)), run(self, seqs, slots, is_prefill, spans))[1])
    base, path, _ = checkpoints["llama"]
    llm = make_llm(path, enable_chunked_prefill=chunked)
    expected_spans = [[(0, 8), (0, 8)], [(8, 9), (8, 9)]] if chunked else [None, None]
    assert calls == [([-1, 0], not chunked, expected_spans[0]), ([-1, 0], False, expected_spans[1])]
    core = llm.engine.core
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    layers = [m for m in core.runner.model.modules() if isinstance(m, LoRALinear)]
    assert layers and not any(m.lora_a.any() or m.lora_b.any() or m.slot_ranks.any() for m in layers)
    prompt = prompts(1, seed=5)[0]
    assert llm.generate(prompt, GREEDY)[0].token_ids == hf_greedy(base, None, prompt, GREEDY.max_tokens)


def test_warm_up_fits_a_cache_of_one_block(checkpoints):
    base, path, _ = checkpoints["llama"]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # k and v, 2 layers, 16 positions, 2 kv heads of 16, fp32
    llm = make_llm(path, kv_cache_memory=block_bytes, max_model_len=16)
    assert llm.engine.core.block_manager.num_blocks == 1
    prompt = prompts(1, seed=6)[0][:6]
    assert llm.generate(prompt, GREEDY)[0].token_ids == hf_greedy(base, None, prompt, GREEDY.max_tokens)


def test_finished_only_steps_give_the_finished_outputs_whole(checkpoints):
    """step(finished_only=True), as LLM.generate runs it: no output for a request still running, and a finished
    one carries all its tokens and logprobs, as the last output of plain steps does."""
    _, path, adapters = checkpoints["llama"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    last = {}
    for finished_only in (False, True):
        llm = make_llm(path, adapters)
        engine = llm.engine
        ids = [engine.add_request(p, params, a) for p, a in zip(prompts(3, seed=11), ["r4", None, "r64_qv"])]
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step(finished_only=finished_only)
        if finished_only:
            assert len(outputs) == 3 and all(o.finished for o in outputs)
        last[finished_only] = {o.request_id: o for o in outputs if o.finished}
        last[finished_only] = [(o.token_ids, o.logprobs.token_ids, o.logprobs.logprobs) for o in
                               (last[finished_only][i] for i in ids)]
    assert last[True] == last[False] and all(len(tokens) == 6 for tokens, _, _ in last[True])


@pytest.mark.parametrize("max_model_len", [1, 2, 5, 9])
@pytest.mark.parametrize("chunked", [False, True])
def test_warm_up_fits_a_short_context(checkpoints, max_model_len, chunked):
    """The warm-up's sequences stay within max_model_len (positions past it have no rotary entry)."""
    base, path, _ = checkpoints["llama"]
    llm = make_llm(path, max_model_len=max_model_len, enable_chunked_prefill=chunked)
    if max_model_len > 1:
        prompt = [5]
        params = SamplingParams(max_tokens=max_model_len - 1, temperature=0, ignore_eos=True)
        assert llm.generate(prompt, params)[0].token_ids == hf_greedy(base, None, prompt, max_model_len - 1)


def test_the_priority_policy_takes_priorities_and_keeps_each_request_its_tokens(checkpoints):
    _, path, adapters = checkpoints["llama"]
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    rows = ["r4", None, "r8_rslora"]
    fcfs = make_llm(path, adapters).generate(prompts, SamplingParams(max_tokens=5, temperature=0), adapters=rows,
                                             use_tqdm=False)
    llm = make_llm(path, adapters, scheduling_policy="priority", max_num_seqs=1)
    params = [SamplingParams(max_tokens=5, temperature=0, priority=p) for p in (7, -1, 0)]
    got = llm.generate(prompts, params, adapters=rows, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in fcfs]
    with pytest.raises(ValueError, match="priority"):
        make_llm(path, scheduling_policy="lottery")
