"""AdapterRecords, the one registry class of the single server's front end and the Ray Serve registry: every
change a new record, a new generation and a save; versions grow with every registration of a name."""
from loramux.server.adapter_registry import AdapterRecords
from loramux.server.engine.wire import AdapterRecord


def test_changes_make_new_records_bump_the_generation_and_are_saved():
    saved = []
    records = AdapterRecords([AdapterRecord("a", "/a")], save=lambda r: saved.append(dict(r)))
    assert dict(records) == {"a": AdapterRecord("a", "/a")} and "a" in records and len(records) == 1
    first, old = records.register(AdapterRecord("b", "/b", ("/dir",)))
    assert (first.version, old, records.generation) == (1, None, 1)
    second, old = records.register(AdapterRecord("b", "/b2"))  # a reload in place: a new version
    assert (second.version, old, records["b"].path) == (2, first, "/b2")
    assert records.set_pinned("b", True) and records["b"].pinned and not second.pinned  # never changed in place
    assert not records.set_pinned("ghost", True)
    records.put_back("b", first)  # a registration undone: the old record, with a new version
    assert records["b"].path == "/b" and records["b"].version == 3
    assert records.remove("a").path == "/a" and records.remove("a") is None
    records.keep(lambda r: not r.pinned)
    assert dict(records) == {"b": records["b"]}
    records.put_back("b", None)
    assert len(records) == 0 and records.generation == 7 and len(saved) == 7 and saved[-1] == {}
