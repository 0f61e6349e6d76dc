"""The engine's LoRA adapter registry: adapters read once at the door, kept in a host LRU of
`max_cpu_loras`, never dropped while a request needs them, read again when named again."""

import pytest

from meshserve.batching.adapters import LoRARequest
from meshserve.model.loading.lora_files import load_lora
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


def test_an_adapter_read_elsewhere_is_kept_and_removed_once_unused(tmp_path):
    """A server reads an adapter off the engine's thread (`add`); `remove` drops it at once
    when nothing runs with it, else makes it the first the LRU drops."""
    in_use: set[int] = set()
    registry = AdapterRegistry(CONFIG, max_rank=8, max_cpu_loras=2, in_use=lambda: in_use)
    requests = [LoRARequest(f"a{i}", i, str(write_adapter(tmp_path / f"a{i}", rank=i)))
                for i in (1, 2, 3)]
    read = load_lora(requests[0].lora_path, CONFIG, max_rank=8)
    registry.add(requests[0], read)
    assert registry.resolve(requests[0]) == 1 and registry.weights(1) is read
    assert registry.max_id == 1
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a1'"):
        registry.add(LoRARequest("b", 1, requests[1].lora_path), read)
    registry.remove(1)
    assert registry.num_loaded == 0
    registry.resolve(requests[0])
    registry.resolve(requests[1])
    two = registry.weights(2)
    registry.weights(1)  # the most recently used
    in_use.add(1)
    registry.remove(1)  # running: kept, but first out
    assert registry.num_loaded == 2
    in_use.clear()
    registry.resolve(requests[2])  # drops 1, not 2
    assert registry.num_loaded == 2 and registry.weights(2) is two
