"""Adapter resolvers: where a name that nobody registered lives. Directory lookups stay inside their
directory (names with `..`, symlinks out), the Hugging Face cache is read offline, plugins are named
module:attribute, and a resolver's answer is checked before anything reads it."""
import json
import os
import sys
import types

import pytest

from loramux.adapters import resolvers


def adapter_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4}, f)
    return os.path.realpath(path)


def test_a_directory_resolver_finds_name_and_org_name_inside_its_directory(tmp_path):
    root = tmp_path / "adapters"
    plain, nested = adapter_dir(root / "tone"), adapter_dir(root / "acme" / "legal")
    found = resolvers.DirectoryResolver(str(root))
    assert found.resolve("base", "tone") == plain
    assert found.resolve("base", "acme/legal") == nested
    assert found.resolve("base", "missing") is None
    assert found.resolve("base", "acme") is None  # a directory without adapter_config.json is no adapter


def test_a_directory_resolver_never_answers_outside_its_directory(tmp_path):
    root = tmp_path / "adapters"
    outside = adapter_dir(tmp_path / "secret")
    adapter_dir(root / "ok")
    os.symlink(outside, root / "link")  # a symlink out of the directory
    found = resolvers.DirectoryResolver(str(root))
    assert found.resolve("base", "../secret") is None
    assert found.resolve("base", "link") is None
    assert found.resolve("base", "ok/../../secret") is None
    assert found.resolve("base", outside) is None  # an absolute path joined onto root is still itself


def test_a_directory_resolver_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        resolvers.DirectoryResolver(str(tmp_path / "nope"))


def hf_snapshot(cache, repo_id: str, revision: str = "0123456789abcdef0123456789abcdef01234567") -> str:
    """The layout huggingface_hub leaves in its cache after a download."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    adapter_dir(snapshot)
    (snapshot / "adapter_model.safetensors").write_bytes(b"")
    return os.path.realpath(snapshot)


def test_the_hf_resolver_finds_a_cached_hub_id_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = hf_snapshot(tmp_path, "acme/legal")
    found = resolvers.HFCacheResolver(str(tmp_path))
    assert found.offline and "offline" in str(found)
    assert found.resolve("base", "acme/legal") == snapshot
    assert found.resolve("base", "acme/missing") is None  # not cached, offline: unknown here, no error
    assert found.resolve("base", "plain") is None  # not a Hub id
    assert resolvers.resolve([found], "base", "acme/legal").allowed_dirs == (os.path.realpath(tmp_path),)


class Fixed:
    def __init__(self, answers: dict | None = None):
        self.answers = answers or {}

    def resolve(self, base_model, name):
        return self.answers.get(name)


def test_plugins_by_module_attribute_as_an_object_a_class_or_a_function(monkeypatch, tmp_path):
    path = adapter_dir(tmp_path / "x")
    module = types.ModuleType("my_resolvers")
    module.instance = Fixed({"x": path})
    module.Cls = Fixed
    module.make = lambda: Fixed({"x": path})
    module.nothing = 3
    monkeypatch.setitem(sys.modules, "my_resolvers", module)
    assert resolvers.from_spec("my_resolvers:instance") is module.instance
    assert isinstance(resolvers.from_spec("my_resolvers:Cls"), Fixed)
    assert resolvers.from_spec("my_resolvers:make").resolve("b", "x") == path
    for spec, error in [("my_resolvers", "module:attribute"), ("my_resolvers:missing", "missing"),
                        ("no_such_module:x", "no_such_module"), ("my_resolvers:nothing", "resolve")]:
        with pytest.raises((ValueError, TypeError), match=error):
            resolvers.from_spec(spec)


def test_resolvers_are_asked_in_order_and_an_answer_without_an_adapter_is_an_error(tmp_path):
    first, second = adapter_dir(tmp_path / "a"), adapter_dir(tmp_path / "b")
    chain = [Fixed({"x": first}), Fixed({"x": second, "y": second})]
    assert resolvers.resolve(chain, "base", "x") == resolvers.Resolved(first, (first,))  # a plugin's own dir
    assert resolvers.resolve(chain, "base", "y").path == second
    assert resolvers.resolve(chain, "base", "z") is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        resolvers.resolve([Fixed({"x": str(tmp_path / "empty")})], "base", "x")


def test_build_orders_directories_the_hf_cache_then_plugins(tmp_path, monkeypatch):
    module = types.ModuleType("my_resolvers")
    module.Cls = Fixed
    monkeypatch.setitem(sys.modules, "my_resolvers", module)
    chain = resolvers.build([str(tmp_path)], hf_cache=True, specs=["my_resolvers:Cls"], plugins=False)
    assert [type(r) for r in chain] == [resolvers.DirectoryResolver, resolvers.HFCacheResolver, Fixed]
    assert resolvers.describe(chain).startswith(f"directory {os.path.realpath(tmp_path)}, huggingface cache")
    assert resolvers.describe([]) == "none"


def test_the_example_store_plugin_copies_an_adapter_to_local_disk_on_first_use(tmp_path, monkeypatch):
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    monkeypatch.syspath_prepend(examples)
    store = tmp_path / "store"
    adapter_dir(store / "tone")
    adapter_dir(store / "base" / "acme" / "legal")  # <base model>/<name> first
    monkeypatch.setenv("ADAPTER_STORE", str(store))
    monkeypatch.setenv("ADAPTER_CACHE", str(tmp_path / "cache"))
    plugin = resolvers.from_spec("store_resolver:StoreResolver")
    found = resolvers.resolve([plugin], "base", "tone")
    local = os.path.realpath(tmp_path / "cache" / "tone")
    assert found == resolvers.Resolved(local, (local,))
    assert os.path.isfile(os.path.join(local, "adapter_config.json"))
    assert resolvers.resolve([plugin], "base", "acme/legal").path == os.path.realpath(tmp_path / "cache" / "acme" / "legal")
    for name in ("missing", "../store/tone", "/etc"):
        assert resolvers.resolve([plugin], "base", name) is None, name


def test_the_example_store_plugin_keeps_copies_across_restarts_and_copies_a_replaced_adapter_again(tmp_path, monkeypatch):
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    monkeypatch.syspath_prepend(examples)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ADAPTER_CACHE", raising=False)
    import store_resolver

    store, other = tmp_path / "store", tmp_path / "other"
    adapter_dir(store / "tone")
    adapter_dir(other / "tone")
    first = store_resolver.StoreResolver(str(store), delay_s=0)
    local = first.resolve("base", "tone")
    assert local.startswith(str(tmp_path / "xdg" / "loramux" / "adapter-store"))
    assert store_resolver.StoreResolver(str(other), delay_s=0).cache != first.cache  # one cache per store

    copies = []
    restarted = store_resolver.StoreResolver(str(store), delay_s=0)
    monkeypatch.setattr(restarted, "_copy", lambda source, dest: copies.append(source) or dest)
    assert restarted.resolve("base", "tone") == local and copies == []  # the copy survives a restart
    with open(store / "tone" / "adapter_config.json", "w") as f:  # replaced in the store (another size, as mtimes can tie)
        json.dump({"peft_type": "LORA", "r": 16}, f)
    monkeypatch.undo()
    monkeypatch.syspath_prepend(examples)
    assert store_resolver.StoreResolver(str(store), cache=os.path.dirname(local), delay_s=0).resolve("base", "tone") == local
    with open(os.path.join(local, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 16
