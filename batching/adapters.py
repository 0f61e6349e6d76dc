"""LoRA adapters as the host sees them: `LoRARequest` (which adapter a request runs with, spelled
as vLLM spells it) and `AdapterSlots` (which adapter each device slot holds).

The device holds `max_loras` adapters at once, in slots 1..max_loras of fixed-shape slabs
(`meshserve.model.lora`); slot 0 is the base model. A running request pins its adapter's slot,
so the slot cannot be given to another adapter under it. Admission takes a slot for a request's
adapter: the slot that holds it already, else a free one, else the least recently used slot
that no running request pins (its adapter is evicted); when every slot is pinned the request
waits, as it waits for pages (`Scheduler.can_hold_adapter`). A slot newly given to an adapter
is a load the engine must make before the step runs (`StepPlan.adapter_loads`).

A pipeline call runs several rounds (step plans) that are all planned, and their loads made,
before it starts: a slot a request lets go of in round k (it reached its length, or was
preempted) is still read by its rows of rounds up to k. While `releases_held` is open, a release
keeps the slot pinned until it closes, once the call's results are back, so no later round of
the call can give the slot to another adapter and have it rewritten under the rows that read it.

Plain Python; like the rest of `batching/` it never imports jax.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: a name, a unique id >= 1, and the PEFT directory it is
    read from (`adapter_config.json`, `adapter_model.safetensors`). Requests with the same id
    share one loaded adapter, and only they share prefix-cache pages."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an int >= 1 (0 is the base "
                             f"model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request {self.lora_name!r} needs lora_path, the adapter's "
                             "directory")


class AdapterSlots:
    """Slots 1..num_slots: the adapter id each holds, how many running requests pin it, and the
    unpinned ones in least recently used order (the first to be given to another adapter)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: dict[int, int] = {}  # adapter id -> its slot
        self._pins = collections.Counter()  # slot -> running requests that use it
        self._unpinned: collections.OrderedDict[int, None] = collections.OrderedDict(
            (slot, None) for slot in range(1, num_slots + 1))  # free slots first, then LRU
        self._loads: list[tuple[int, int]] = []
        self._held: list[int] | None = None  # releases kept until `releases_held` closes
        self.num_evictions = 0  # adapters a load pushed out of their slot, over the life

    @property
    def num_resident(self) -> int:
        """Slots that hold an adapter (pinned or not)."""
        return len(self._slot_of)

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot_of.get(adapter_id)

    def can_acquire(self, adapter_id: int) -> bool:
        """Whether `acquire` would find a slot: the adapter's own, or one nobody pins."""
        return adapter_id in self._slot_of or bool(self._unpinned)

    def acquire(self, adapter_id: int) -> int:
        """Pins a slot for `adapter_id` (see the module docstring) and returns it."""
        slot = self._slot_of.get(adapter_id)
        if slot is None:
            slot, _ = self._unpinned.popitem(last=False)
            evicted = next((a for a, s in self._slot_of.items() if s == slot), None)
            if evicted is not None:
                del self._slot_of[evicted]
                self.num_evictions += 1
            self._slot_of[adapter_id] = slot
            self._loads.append((slot, adapter_id))
        elif self._pins[slot] == 0:
            del self._unpinned[slot]
        self._pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A running request let go of its slot; the last one makes it the most recently used
        of the unpinned slots. While `releases_held` is open, it happens when that closes."""
        assert self._pins[slot] > 0, slot
        if self._held is not None:
            self._held.append(slot)
            return
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            del self._pins[slot]
            self._unpinned[slot] = None

    @contextlib.contextmanager
    def releases_held(self) -> Iterator[None]:
        """Keeps every slot released inside pinned until the block ends (see the module
        docstring): the slots a running call may read stay with their adapters."""
        assert self._held is None, "releases are held already"
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            for slot in held:
                self.release(slot)

    def forget(self) -> None:
        """Forgets what every slot holds (another engine sharing the runner wrote its own
        adapters there); nothing may be pinned."""
        assert not self._pins, "forget() with running requests"
        self._slot_of.clear()
        self._loads.clear()

    def take_loads(self) -> tuple[tuple[int, int], ...]:
        """The `(slot, adapter id)` pairs given out since the last call: the device must load
        each adapter into its slot before the next step runs."""
        loads, self._loads = tuple(self._loads), []
        return loads

    def check(self) -> None:
        assert len(set(self._slot_of.values())) == len(self._slot_of)
        assert all(self._pins[s] > 0 for s in self._pins)
        assert not set(self._pins) & set(self._unpinned)
        assert len(self._pins) + len(self._unpinned) == self.num_slots
