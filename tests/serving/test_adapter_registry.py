"""The engine's LoRA adapter registry: adapters read once at the door, kept in a host LRU of
`max_cpu_loras`, never dropped while a request needs them, read again when named again."""

import pytest

from meshserve.batching.adapters import LoRARequest
from meshserve.serving.engine.adapter_registry import AdapterRegistry
from tests.model.test_lora import CONFIG, write_adapter


def test_the_host_keeps_the_most_recently_used_adapters_that_fit(tmp_path):
    in_use: set[int] = set()
    registry = AdapterRegistry(CONFIG, max_rank=8, max_cpu_loras=2, in_use=lambda: in_use)
    requests = [LoRARequest(f"a{i}", i, str(write_adapter(tmp_path / f"a{i}", rank=i + 1)))
                for i in (1, 2, 3, 4)]
    assert [registry.resolve(r) for r in requests[:2]] == [1, 2]
    first = registry.weights(1)
    assert registry.resolve(requests[2]) == 3  # 2 is the least recently used: dropped
    assert registry.num_loaded == 2 and registry.weights(1) is first
    in_use |= {1, 3}
    second = registry.weights(2)  # read again; 1 and 3 are needed: kept over the limit
    assert second.rank == 3 and registry.num_loaded == 3
    in_use.clear()  # the next read trims back to the limit, least recently used first
    assert registry.resolve(requests[3]) == 4 and registry.num_loaded == 2
    assert registry.weights(2) is second and registry.num_loaded == 2


def test_an_id_names_one_adapter(tmp_path):
    registry = AdapterRegistry(CONFIG, max_rank=8, max_cpu_loras=1, in_use=set)
    path = str(write_adapter(tmp_path / "a"))
    registry.resolve(LoRARequest("a", 1, path))
    registry.resolve(LoRARequest("a", 1, path))  # the same again is fine
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
        registry.resolve(LoRARequest("b", 1, path))
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        registry.resolve(("a", 1, path))
