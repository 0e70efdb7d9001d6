"""Per-adapter residency for LoRA-aware routers: one series per adapter and tier while it is there."""
from loramux.server.http.metrics import Metrics
from loramux.server.engine.wire import EngineStats, SpecDecodeStats


def stats(resident: dict, pinned: list) -> EngineStats:
    return EngineStats(1, 0, 0, [], [], 4, 3, pinned, 0, 0, 0, 10, 10, 1, 1, 1, {}, resident=resident)


def test_an_adapter_has_a_residency_series_per_tier_while_it_is_there():
    metrics = Metrics()
    text = metrics.render(stats({"host": ["a", "b", "p"], "device": ["a", "p"]}, ["p"])).decode()
    series = sorted(line for line in text.splitlines() if line.startswith("loramux:lora_adapter_resident{"))
    assert series == ['loramux:lora_adapter_resident{adapter="a",pinned="false",tier="device"} 1.0',
                      'loramux:lora_adapter_resident{adapter="a",pinned="false",tier="host"} 1.0',
                      'loramux:lora_adapter_resident{adapter="b",pinned="false",tier="host"} 1.0',
                      'loramux:lora_adapter_resident{adapter="p",pinned="true",tier="device"} 1.0',
                      'loramux:lora_adapter_resident{adapter="p",pinned="true",tier="host"} 1.0']
    text = metrics.render(stats({"host": ["b"], "device": []}, [])).decode()  # a and p evicted
    series = [line for line in text.splitlines() if line.startswith("loramux:lora_adapter_resident{")]
    assert series == ['loramux:lora_adapter_resident{adapter="b",pinned="false",tier="host"} 1.0']


def test_speculative_decoding_has_vllms_counters_and_one_series_per_adapter():
    spec = SpecDecodeStats(4, 10, 6, [3, 2, 1], {"": [4, 1], "a": [6, 5]})
    text = Metrics().render(EngineStats(1, 0, 0, [], [], 4, 3, [], 0, 0, 0, 10, 10, 1, 1, 1, {},
                                        spec_decode=spec)).decode()
    lines = set(text.splitlines())
    for line in ("loramux:spec_decode_num_drafts_total 4.0", "loramux:spec_decode_num_draft_tokens_total 10.0",
                 "loramux:spec_decode_num_accepted_tokens_total 6.0",
                 'loramux:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0',
                 'loramux:spec_decode_adapter_draft_tokens_total{adapter=""} 4.0',
                 'loramux:spec_decode_adapter_accepted_tokens_total{adapter="a"} 5.0'):
        assert line in lines, line
    assert "spec_decode" not in Metrics().render(stats({}, [])).decode()  # off: no series


def test_the_ray_ingress_shows_each_replicas_speculative_decoding_counters():
    import msgspec

    from loramux.server.ray.ingress import render_metrics

    engine = msgspec.structs.asdict(EngineStats(1, 0, 0, [], [], 4, 0, [], 0, 0, 0, 10, 10, 1, 1, 1, {},
                                                spec_decode=SpecDecodeStats(3, 9, 5, [2, 2, 1], {})))
    replica = {"loaded": [], "healthy": 1, "pid": 11, "engine_pid": 12, "engine": engine}
    text = render_metrics({"r1": replica, "r2": {**replica, "engine": {**engine, "spec_decode": None}}}, 0, 1).decode()
    assert 'loramux:spec_decode_num_accepted_tokens_total{replica="r1"} 5.0' in text
    assert 'loramux:spec_decode_num_drafts_total{replica="r1"} 3.0' in text and 'replica="r2"} ' not in \
        "".join(line for line in text.splitlines() if "spec_decode" in line)
