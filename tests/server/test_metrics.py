"""Per-adapter residency for LoRA-aware routers: one series per adapter and tier while it is there."""
from loramux.server.http.metrics import Metrics
from loramux.server.engine.wire import EngineStats


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
