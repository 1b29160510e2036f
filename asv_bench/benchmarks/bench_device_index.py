"""The key index on the device (cncore_torch.device_index) beside the core's, on the
accelerator when there is one, else on the CPU (where torch's kernels, not an accelerator's,
are what it measures): find, find_or_insert of known keys, and filling it with new keys."""
import numpy as np
import torch

import cncore
from cncore_torch.device_index import DeviceKeyIndex

from .common import SMOKE, rng

N_KEYS = 20_000 if SMOKE else 1_000_000
CALL = 4_096 if SMOKE else 65_536
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class DeviceIndex:
    """`index` "device": DeviceKeyIndex on DEVICE; "core": EmbeddingStore's index on the host.
    Each call gets `CALL` keys of a table holding `N_KEYS`."""
    params = [["device", "core"]]
    param_names = ["index"]
    number = 1

    def setup(self, index):
        keys = rng(7).integers(-2**63, 2**63 - 1, N_KEYS, dtype=np.int64)
        self.batch = keys[rng(8).integers(0, N_KEYS, CALL)]
        self.new = rng(9).integers(-2**63, 2**63 - 1, CALL, dtype=np.int64)
        if index == "device":
            self.index = DeviceKeyIndex(cncore.StoreConfig(dim=1), DEVICE)
            for i in range(0, N_KEYS, CALL):
                self.index.find_or_insert(torch.from_numpy(keys[i:i + CALL]).to(DEVICE))
            self.batch, self.new = (torch.from_numpy(a).to(DEVICE) for a in (self.batch, self.new))
        else:
            self.index = cncore.EmbeddingStore(dim=1)
            self.index.find_or_insert(keys)
        _sync()

    def time_find(self, index):
        self.index.find(self.batch)
        _sync()

    def time_find_or_insert_known(self, index):
        self.index.find_or_insert(self.batch)
        _sync()

    def time_find_or_insert_new(self, index):
        self.index.find_or_insert(self.new)
        _sync()
