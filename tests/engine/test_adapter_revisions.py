"""Revisions: every load of a name is a revision (name@rev). With keep_revisions N, a reload in place keeps the
N - 1 revisions before it addressable as name@rev, each on its own weights, while the bare name serves the
newest; older ones leave, an unload takes them all, and a revision whose files were overwritten by the reload
stays on the weights it was loaded with."""
import shutil

import pytest

from conftest import save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.llm import LLM

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("revisions")
    base = tiny_llama()
    versions = [save_peft_adapter(base, root / f"v{i}", seed=20 + i, r=8) for i in range(4)]
    return save_checkpoint(base, root / "model"), versions, root


def make_llm(model, keep: int, **lora) -> LLM:
    config = LoRAConfig(**{"max_loras": 2, "max_lora_rank": 16, "keep_revisions": keep, **lora})
    return LLM(model=model, lora=config, dtype="float32", kv_cache_memory=2**23, max_model_len=64)


def tokens(llm, adapter) -> list[int]:
    return llm.generate([PROMPT], GREEDY, adapters=adapter, use_tqdm=False)[0].token_ids


def reference(llm, versions) -> list[list[int]]:
    """Each version's tokens, loaded under a name of its own."""
    for i, path in enumerate(versions):
        assert llm.load_adapter(f"ref{i}", path)
    answer = [tokens(llm, f"ref{i}") for i in range(len(versions))]
    for i in range(len(versions)):
        llm.unload_adapter(f"ref{i}")
    return answer


def test_each_kept_revision_runs_its_own_weights_and_the_name_the_newest(files):
    model, versions, _ = files
    llm = make_llm(model, keep=3)
    expected = reference(llm, versions)
    assert len({tuple(t) for t in expected}) == len(versions)  # the versions answer apart
    loads = [llm.load_adapter("live", versions[0])]
    loads += [llm.load_adapter("live", path, replace=True) for path in versions[1:3]]
    revisions = [r.revision for r in loads]
    assert all(loads) and len(set(revisions)) == 3 and all(r.startswith("live@") for r in revisions)
    assert tokens(llm, "live") == expected[2]
    for revision, answer in zip(revisions, expected):
        out = llm.generate([PROMPT], GREEDY, adapters=revision, use_tqdm=False)[0]
        assert out.token_ids == answer and out.revision == revision
    assert llm.engine.adapters.kept_revisions == {"live": revisions[:2]}
    newest = llm.load_adapter("live", versions[3], replace=True).revision  # the oldest kept one leaves
    assert llm.engine.adapters.kept_revisions == {"live": [revisions[1], revisions[2]]}
    with pytest.raises(ValueError, match="unknown adapter"):
        tokens(llm, revisions[0])
    assert tokens(llm, revisions[1]) == expected[1] and tokens(llm, newest) == tokens(llm, "live") == expected[3]
    assert llm.unload_adapter("live")
    for revision in (*revisions[1:], newest):
        with pytest.raises(ValueError, match="unknown adapter"):
            tokens(llm, revision)
    assert llm.engine.adapters.kept_revisions == {} and len(llm.engine.adapters.cache) == 0


def test_by_default_only_the_current_revision_is_addressable(files):
    model, versions, _ = files
    llm = make_llm(model, keep=1)
    first = llm.load_adapter("live", versions[0]).revision
    assert tokens(llm, first) == tokens(llm, "live")
    second = llm.load_adapter("live", versions[1], replace=True).revision
    assert second != first and tokens(llm, second) == tokens(llm, "live")
    with pytest.raises(ValueError, match="unknown adapter"):
        tokens(llm, first)
    assert len(llm.engine.adapters.cache) == 1  # nothing kept


def test_a_revision_reloaded_over_its_own_files_keeps_its_weights_in_host_memory(files, tmp_path):
    """vLLM's way of updating an adapter: new files over the old, then a reload in place from the same directory.
    The earlier revision's files are gone, so it stays in host memory (never dropped there) while it is kept,
    however many other adapters pass through the host tier."""
    model, versions, _ = files
    llm = make_llm(model, keep=2, max_cpu_loras=2)
    expected = reference(llm, versions)
    live = tmp_path / "live"
    shutil.copytree(versions[0], live)
    first = llm.load_adapter("live", str(live)).revision
    shutil.rmtree(live)
    shutil.copytree(versions[1], live)
    assert llm.load_adapter("live", str(live), replace=True)
    for i in (2, 3):  # other adapters through a host tier of two
        assert llm.load_adapter(f"other{i}", versions[i]) and tokens(llm, f"other{i}") == expected[i]
    assert tokens(llm, first) == expected[0] and tokens(llm, "live") == expected[1]


def test_a_request_on_a_revision_fails_clearly_once_it_is_no_longer_kept(files):
    model, versions, _ = files
    llm = make_llm(model, keep=2)
    first = llm.load_adapter("live", versions[0]).revision
    engine = llm.engine
    engine.add_request(PROMPT, GREEDY, first, request_id="queued")  # not yet admitted
    assert llm.load_adapter("live", versions[1], replace=True)
    assert llm.load_adapter("live", versions[2], replace=True)  # the first revision leaves
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "queued" and outputs[-1].finish_reason == "error"



def test_a_name_that_looks_like_a_revision_is_itself_first(files):
    model, versions, _ = files
    llm = make_llm(model, keep=2)
    assert llm.load_adapter("live", versions[0]) == LoRAStatus.SUCCESS
    assert llm.load_adapter("live@0123abcd", versions[1])  # a name of its own (the naming rule allows it)
    assert llm.load_adapter("v1", versions[1])
    assert tokens(llm, "live@0123abcd") == tokens(llm, "v1") != tokens(llm, "live")


def test_a_name_is_looked_up_once_until_the_names_change(files, monkeypatch):
    """A request's name is checked when it is added and resolved when it is admitted, and a waiting request is
    looked at every step: all of them share one lookup per name until a load or unload changes the names."""
    from loramux.adapters.store import AdapterStore

    model, versions, _ = files
    llm = make_llm(model, keep=2)
    for name, path in (("a", versions[0]), ("b", versions[1])):
        assert llm.load_adapter(name, path)
    found = []
    real = AdapterStore._find
    monkeypatch.setattr(AdapterStore, "_find", lambda self, m: found.append(m) or real(self, m))
    llm.generate([PROMPT] * 16, GREEDY, adapters=["a", "b"] * 8, use_tqdm=False)
    assert sorted(found) == ["a", "b"]
    revision = llm.load_adapter("a", versions[2], replace=True).revision
    llm.generate([PROMPT] * 4, GREEDY, adapters=["a", revision] * 2, use_tqdm=False)
    assert sorted(found[2:]) == sorted(["a", revision])
