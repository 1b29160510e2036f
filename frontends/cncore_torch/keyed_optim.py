"""The fused optimizer of a TorchRec-style collection as a TorchRec `KeyedOptimizer`, so that it
sits in `torchrec.optim.CombinedOptimizer` next to the dense network's optimizer (as the fused
optimizer of TorchRec's own fused tables does). Its state is the tables' step; the rows'
optimizer state lives with the rows in the model's `state_dict`. As with every KeyedOptimizer,
the learning rate is saved after `save_param_groups(True)` (or by the scheduler's own
state_dict). A module-level class, so that `torch.save` of a whole collection pickles it.
"""
from __future__ import annotations

import torch
from torchrec.optim.keyed import KeyedOptimizer

__all__ = ["KeyedFusedOptimizer"]


class KeyedFusedOptimizer(KeyedOptimizer):
    def __init__(self, anchor: torch.nn.Parameter, config, stores, key: str):
        super().__init__({key: anchor}, {anchor: {"step": torch.tensor(0, dtype=torch.int64)}},
                         [{"params": [anchor], "lr": config.lr}])
        self._anchor, self._key, self._stores = anchor, key, stores

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    def step(self, closure=None):
        """Nothing to do: the rows were updated in backward. Records the tables' step."""
        self.state[self._anchor]["step"] = torch.tensor(self._stores[0].step, dtype=torch.int64)
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: fused tables keep no gradient."""

    def state_dict(self):
        self.state[self._anchor]["step"] = torch.tensor(self._stores[0].step, dtype=torch.int64)
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        """The tables' step is checked before anything changes: an int tensor >= 0."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict (from state_dict()), got {type(state_dict).__name__}")
        entry = state_dict.get("state")
        entry = entry.get(self._key) if isinstance(entry, dict) else None
        step = entry.get("step") if isinstance(entry, dict) else None
        if (not isinstance(step, torch.Tensor) or step.is_meta or step.numel() != 1
                or step.is_floating_point() or step.dtype == torch.bool or not 0 <= int(step) < 2**63):
            raise ValueError(f"state_dict['state'][{self._key!r}]['step'] must be an int tensor >= 0 (as "
                             f"state_dict() writes it), got {step!r}")
        super().load_state_dict(state_dict)
        for store in self._stores:
            store.step = int(step)
