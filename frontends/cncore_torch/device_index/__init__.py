"""A key index in device memory for accelerator tables (`device="cncard"`), built from torch ops
so that it runs on every torch device: `DeviceKeyIndex` (find, find_or_insert with admission,
erase, growth, bounded eviction with the core's exact order) and the core's row initialiser as
torch ops (`initial_rows`). The design: docs/design/device-index.md.
"""
from cncore_torch.device_index.hashing import initial_rows, initializes_on_device, mix64
from cncore_torch.device_index.index import MAX_LOAD, WAYS, DeviceKeyIndex, EvictedSlots, InsertResult

__all__ = ["DeviceKeyIndex", "EvictedSlots", "InsertResult", "MAX_LOAD", "WAYS", "initial_rows",
           "initializes_on_device", "mix64"]
