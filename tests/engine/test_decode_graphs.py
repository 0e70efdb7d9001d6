"""Decode steps shaped for CUDA graphs, checked on the CPU: the inputs live in buffers allocated once; the
forward over them reads nothing back from the device; its ops and the tensors it reads from outside do not
depend on the batch (two batches padded to one size run the same ops on the same storages), so a graph
captured on one replays any other; padding rows touch no sequence's KV cache; and the sampler reads the
device once a step. The ops are the ones a GPU runs (the Triton kernels, in its interpreter)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import EngineConfig, LoRAConfig, SamplingParams
from loramux.engine.cuda_graphs import capture_sizes, graph_blockers
from loramux.engine.engine_core import EngineCore
from loramux.engine.sequence import Sequence
from loramux.layers.sampler import SamplingRow, sample_and_score
from loramux.ops import attention_triton, lora_triton
from loramux.ops.triton_tiles import AttentionTiles, LoRATiles

pytestmark = pytest.mark.skipif(not lora_triton.available("cpu"), reason="needs triton and TRITON_INTERPRET=1")

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# Tensor methods that read values back to the host: on a GPU, each one waits for the device
_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu", "nonzero")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    base = tiny_llama()
    adapters = {name: save_peft_adapter(base, root / name, seed=seed, r=8) for name, seed in (("a", 1), ("b", 2))}
    config = EngineConfig(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**22,
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8), max_model_len=64, max_num_seqs=8,
                          lora_backend="triton", attention_backend="triton", pointwise_backend="triton")
    core = EngineCore(config)
    for name, path in adapters.items():
        assert core.adapters.load_adapter(name, path)
    return base, adapters, core


class _Reads:
    """Counts host reads of tensor values while active."""

    def __init__(self, monkeypatch):
        self.count, self.active = 0, False
        for name in _READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += self.active
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _where(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:  # an opaque tensor (a prepacked weight): the same object each step
        return id(t)


class _Trace(TorchDispatchMode):
    """Each op of a forward with its argument shapes, and the storages it reads that no op of it made."""

    def __init__(self):
        super().__init__()
        self.ops, self.outside, self._made = [], [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for a in (*args, *(kwargs or {}).values()) for a in (a if isinstance(a, (list, tuple)) else (a,))]
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), tuple((tuple(t.shape), t.dtype) for t in tensors)))
        self.outside += [_where(t) for t in tensors if _where(t) not in self._made]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self._made.add(_where(t))
        return out


def _prefilled(core, prompts: list[list[int]], names: list[str | None]) -> tuple[list[Sequence], list[int]]:
    """Sequences placed and prefilled by the runner, ready to decode, and their slots."""
    slots = [core.adapters.activate_adapter(n) if n else -1 for n in names]
    seqs = [Sequence(list(p), GREEDY, n, f"r{i}") for i, (p, n) in enumerate(zip(prompts, names))]
    for seq in seqs:
        core.block_manager.allocate(seq)
    for seq, out in zip(seqs, core.runner.run(seqs, slots, is_prefill=True)):
        seq.num_computed_tokens = len(seq)
        seq.append_token(out.token)
        core.block_manager.may_append(seq)
    return seqs, slots


def _release(core, seqs):
    for seq in seqs:
        core.block_manager.deallocate(seq)
        core.runner.release(seq)


def test_decode_steps_feed_the_model_from_one_set_of_buffers_and_stay_exact(setup, monkeypatch):
    base, adapters, core = setup
    runner = core.runner
    seen = []
    model = runner.model

    class Recording:  # the model as the runner calls it, noting where each decode step's inputs live
        def __call__(self, ids, positions, meta):
            if not meta.is_prefill and meta.chunks is None:
                seen.append((ids.untyped_storage().data_ptr(), positions.untyped_storage().data_ptr(),
                             meta.block_tables.untyped_storage().data_ptr()))
            return model(ids, positions, meta)

        def __getattr__(self, name):
            return getattr(model, name)

    monkeypatch.setattr(runner, "model", Recording())
    prompts = {"x": [5, 9, 14, 3], "y": [7, 7, 21, 40, 2], "z": [11, 12]}
    names = {"x": "a", "y": None, "z": "b"}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, GREEDY, names[rid])
    tokens = {rid: [] for rid in prompts}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(base, adapters.get(names[rid]), prompt, GREEDY.max_tokens)
    buffer = runner.decode_inputs.device_side.untyped_storage().data_ptr()
    assert len(seen) >= GREEDY.max_tokens - 1 and set(seen) == {(buffer, buffer, buffer)}


def test_a_decode_forward_reads_nothing_back_and_the_sampler_reads_once(setup, monkeypatch):
    _, _, core = setup
    seqs, slots = _prefilled(core, [[5, 9, 14, 3], [7, 7, 21], [2, 3]], ["a", None, "b"])
    reads = _Reads(monkeypatch)
    try:
        reads.active = True
        with torch.inference_mode():
            hidden = core.runner._decode(seqs, slots)
            assert reads.count == 0
            logits = core.runner.model.compute_logits(hidden)
            assert reads.count == 0
            rows = [SamplingRow(GREEDY, [], None), SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
                                                                   [], torch.Generator().manual_seed(3)),
                    SamplingRow(SamplingParams(temperature=1.0, min_p=0.1), [], torch.Generator().manual_seed(4))]
            # as on a GPU: drawn where the logits are; two rows' logprobs (k = 3 and 0) in the same read
            tokens, logprobs = sample_and_score(logits, rows, {0: 3, 2: 0}, on_host=False)
        assert reads.count == 1 and all(isinstance(t, int) for t in tokens)
        assert len(logprobs[0].top_ids[0]) == 3 and logprobs[2].top_ids == [[]] and logprobs[0].ranks == [1]
    finally:
        reads.active = False
        _release(core, seqs)


def _trace(core, seqs, slots, size):
    runner = core.runner
    runner.decode_inputs.fill(seqs, slots, size)
    trace = _Trace()
    with torch.inference_mode(), trace:
        out = runner._decode_forward(size)
    return trace, out[:len(seqs)].clone()


def _assert_graph_shaped(core, first, second) -> None:
    """Two prefilled batches (sequences, slots) padded to 4 rows: the same ops with the same shapes on the same
    outside storages, no tensor made from host data, and each padded row equal to the eager forward's."""
    try:
        (trace_1, out_1), (trace_2, out_2) = _trace(core, *first, 4), _trace(core, *second, 4)
        assert trace_1.ops == trace_2.ops and trace_1.outside == trace_2.outside
        assert not [op for op, _ in trace_1.ops if "lift_fresh" in op or "_local_scalar_dense" in op]
        for (seqs, slots), padded in ((first, out_1), (second, out_2)):
            with torch.inference_mode():
                core.runner.decode_inputs.fill(seqs, slots)
                eager = core.runner._decode_forward(len(seqs), slots, max(len(s.block_table) for s in seqs))
            torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    finally:
        _release(core, first[0] + second[0])


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_decode_forwards_padded_to_one_size_run_the_same_ops_on_the_same_storages(setup, split, monkeypatch):
    """What a CUDA graph needs of the forward it captures: whatever the batch (sizes, adapters, lengths), the
    same ops with the same shapes, reading the same tensors from outside (weights, slots, caches, inputs) and
    no tensor made from host data; a padded batch's rows equal the eager forward's. split: as on a GPU of 132
    SMs with pieces of 16 inputs or positions, the LoRA shrink split-K and attention split-KV."""
    _, _, core = setup
    if split:
        for module in (lora_triton, attention_triton):
            monkeypatch.setattr(module, "multiprocessors", lambda device: 132)
        monkeypatch.setattr(lora_triton, "lora_tiles", lambda device, n: LoRATiles(block_k=16, split_min_k=16))
        monkeypatch.setattr(attention_triton, "attention_tiles",
                            lambda device, n: AttentionTiles(block_n=16, split_min_len=16))
        assert lora_triton.split_k(LoRATiles(split_min_k=16), 4, 2, 3, 64, "cpu") > 1
    first = _prefilled(core, [[5, 9, 14, 3], [7, 7, 21, 40, 2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]],
                       ["a", None])
    second = _prefilled(core, [[2, 3], [4, 4, 4], [6] * 20], ["b", "a", "b"])
    _assert_graph_shaped(core, first, second)


def test_padding_rows_write_only_the_scratch_rows(setup):
    _, _, core = setup
    runner = core.runner
    seqs, slots = _prefilled(core, [[5, 9, 14, 3], [7, 7, 21]], ["a", None])
    try:
        scratch = runner.num_blocks * runner.block_size
        runner.kv_cache[:, :, scratch:] = 0  # (earlier padded steps wrote the same values there)
        before = runner.kv_cache.clone()
        _trace(core, seqs, slots, 8)
        changed = (runner.kv_cache != before).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
        size = runner.block_size
        own = {s.block_table[(len(s) - 1) // size] * size + (len(s) - 1) % size for s in seqs}
        assert set(changed) - own == {scratch}  # padding rows: the scratch row only
    finally:
        _release(core, seqs)


def test_graph_sizes_and_what_keeps_decode_eager(setup):
    _, _, core = setup
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(12) == (1, 2, 4, 8, 12) and capture_sizes(1) == (1,)
    runner, config = core.runner, core.config
    decode_op = runner.model.attention_layers()[0].decode_op
    assert graph_blockers(runner.model, config, runner.slots.add_lora, decode_op) == []
    assert runner.graphs is None  # a CPU: no graphs, the same buffers
    eager = graph_blockers(runner.model, EngineConfig(model=config.model, enforce_eager=True, batch_invariant=True),
                           lora_triton.add_lora_triton, decode_op)
    assert [r.split()[0] for r in eager] == ["enforce_eager", "batch_invariant"]
    from loramux.ops.lora_torch import add_lora_segmented
    assert "segments on the host" in graph_blockers(runner.model, config, add_lora_segmented, decode_op)[0]


@pytest.fixture(scope="module")
def embedding_setup(tmp_path_factory):
    """LoRA on the embedding too (PEFT's lora_embedding_A/B), with the graph-safe op: and an adapter that
    saves a whole embedding table (modules_to_save)."""
    from conftest import save_distinct_adapter

    root = tmp_path_factory.mktemp("graphs-emb")
    base = tiny_llama()
    emb = save_distinct_adapter(base, root / "emb", 1, r=4, target_modules=["embed_tokens", "q_proj"])
    saved = save_distinct_adapter(base, root / "saved", 2, r=4, target_modules=["o_proj"],
                                  modules_to_save=["embed_tokens"])
    copies = 2 * base.config.vocab_size * base.config.hidden_size * 4
    config = EngineConfig(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**22,
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8, max_module_copies_bytes=copies,
                                          target_modules=("q_proj", "o_proj", "embed_tokens")),
                          max_model_len=64, max_num_seqs=8, lora_backend="triton", attention_backend="triton",
                          pointwise_backend="triton")
    core = EngineCore(config)
    assert core.adapters.load_adapter("emb", emb) and core.adapters.load_adapter("saved", saved)
    return base, {"emb": emb, "saved": saved}, core


def test_embedding_lora_runs_through_the_op_in_a_graph_shaped_forward(embedding_setup):
    """The embedding's LoRA through the op keeps decode capturable: no blocker, and two batches padded to one
    size (embedding-LoRA rows or not) run the same ops on the same storages, each row as the eager forward's."""
    _, _, core = embedding_setup
    runner = core.runner
    decode_op = runner.model.attention_layers()[0].decode_op
    assert graph_blockers(runner.model, core.config, runner.slots.add_lora, decode_op) == []
    first = _prefilled(core, [[5, 9, 14, 3], [7, 7, 21]], ["emb", None])
    second = _prefilled(core, [[2, 3], [4, 4, 4], [6] * 9], [None, None, "emb"])
    _assert_graph_shaped(core, first, second)


def test_a_saved_embedding_table_in_a_slot_turns_decode_eager_and_stays_exact(embedding_setup):
    """A whole saved embedding table picks rows per slot, which a graph cannot replay: while one is in a slot the
    runner decodes eagerly (checked here by the flag it reads), and the tokens stay HF + PEFT's."""
    base, adapters, core = embedding_setup
    slots = core.runner.slots
    core.adapters.deactivate_adapter("saved")
    assert not slots.needs_eager
    core.adapters.activate_adapter("saved")
    assert slots.needs_eager
    for name in ("saved", "emb"):
        core.add_request(name, [5, 9, 14, 3], GREEDY, name)
    tokens = {"saved": [], "emb": []}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    for name in ("saved", "emb"):
        assert tokens[name] == hf_greedy(base, adapters[name], [5, 9, 14, 3], GREEDY.max_tokens), name


def test_a_mixture_of_experts_decode_is_graph_shaped_with_expert_lora(tmp_path):
    """MoE with the Triton fused-experts op (a grouped GEMM per projection, no host count of each expert's
    tokens): no blocker, and two batches routed differently, with and without expert LoRA, run the same ops on
    the same storages, each row as the eager forward's."""
    from conftest import save_distinct_adapter
    from models.test_moe import tiny_moe

    base = tiny_moe("qwen3_moe")
    experts = save_distinct_adapter(base, tmp_path / "experts", 1, r=4, target_modules=["q_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    config = EngineConfig(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8,
                                          target_modules=("q_proj", "experts")),
                          max_model_len=64, max_num_seqs=8, lora_backend="triton", attention_backend="triton",
                          pointwise_backend="triton", moe_backend="triton")
    core = EngineCore(config)
    assert core.adapters.load_adapter("experts", experts)
    runner = core.runner
    decode_op = runner.model.attention_layers()[0].decode_op
    assert graph_blockers(runner.model, core.config, runner.slots.add_lora, decode_op) == []
    first = _prefilled(core, [[5, 9, 14, 3], [7, 7, 21]], ["experts", None])
    second = _prefilled(core, [[2, 3], [40, 41, 42], [6] * 9], [None, None, None])
    _assert_graph_shaped(core, first, second)
