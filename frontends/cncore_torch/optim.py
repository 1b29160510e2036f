"""`FusedOptimizer`: the optimizer a table applies inside its backward, seen from PyTorch.

It is a real `torch.optim.Optimizer` over the module's zero-size anchor parameter, so learning
rate schedulers (`torch.optim.lr_scheduler.*`) drive it through `param_groups`; `step()` and
`zero_grad()` do nothing (the update already happened in backward, as in TorchRec's fused
tables). `state_dict()` carries the learning rate and the table's step.

>>> import torch
>>> from cncore_torch import CNEmbeddingBag
>>> import cncore
>>> bag = CNEmbeddingBag(10, 4, optimizer=cncore.SGD(lr=0.1))
>>> sched = torch.optim.lr_scheduler.StepLR(bag.fused_optimizer, step_size=1, gamma=0.5)
>>> bag.fused_optimizer.step(); sched.step(); bag.fused_optimizer.param_groups[0]["lr"]
0.05
"""
from __future__ import annotations

import math

import torch

__all__ = ["FusedOptimizer"]


class FusedOptimizer(torch.optim.Optimizer):
    def __init__(self, anchor: torch.nn.Parameter, config, store_ref):
        self._config = config
        self._store_ref = store_ref  # a callable returning the store (or None before materialisation)
        super().__init__([anchor], {"lr": config.lr})

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    def step(self, closure=None):
        """Nothing to do: the rows were updated in backward. Runs `closure` if given."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: a fused table keeps no gradient."""

    def state_dict(self):
        store = self._store_ref()
        return {"lr": self.lr, "step": store.step if store is not None else 0,
                "optimizer": type(self._config).__name__}

    def load_state_dict(self, state_dict) -> None:
        """Checked whole before anything changes: the optimizer's name, lr a finite number >= 0,
        step an int >= 0."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict (from state_dict()), got {type(state_dict).__name__}")
        if state_dict.get("optimizer") != type(self._config).__name__:
            raise ValueError(f"state_dict is for {state_dict.get('optimizer')!r}, this table uses "
                             f"{type(self._config).__name__!r}")
        lr, step = state_dict.get("lr"), state_dict.get("step")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"state_dict['lr'] must be a finite number >= 0, got {lr!r}")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
            raise ValueError(f"state_dict['step'] must be an int in [0, 2**63), got {step!r}")
        self.param_groups[0]["lr"] = float(lr)
        store = self._store_ref()
        if store is not None:
            store.step = step


def keyed_fused_optimizer(anchor: torch.nn.Parameter, config, stores, key: str):
    """The fused optimizer of a TorchRec-style collection as a TorchRec `KeyedOptimizer`, so it
    sits in `torchrec.optim.CombinedOptimizer` next to the dense network's optimizer (as the
    fused optimizer of TorchRec's own fused tables does). Its state is the tables' step; the
    rows' optimizer state lives with the rows in the model's `state_dict`. As with every
    KeyedOptimizer, the learning rate is saved after `save_param_groups(True)` (or by the
    scheduler's own state_dict)."""
    from torchrec.optim.keyed import KeyedOptimizer

    class KeyedFusedOptimizer(KeyedOptimizer):
        def __init__(self):
            super().__init__({key: anchor}, {anchor: {"step": torch.tensor(0, dtype=torch.int64)}},
                             [{"params": [anchor], "lr": config.lr}])
            self._stores = stores

        @property
        def lr(self) -> float:
            return float(self.param_groups[0]["lr"])

        def step(self, closure=None):
            """Nothing to do: the rows were updated in backward. Records the tables' step."""
            self.state[anchor]["step"] = torch.tensor(self._stores[0].step, dtype=torch.int64)
            return closure() if closure is not None else None

        def zero_grad(self, set_to_none: bool = True) -> None:
            """Nothing to do: fused tables keep no gradient."""

        def state_dict(self):
            self.state[anchor]["step"] = torch.tensor(self._stores[0].step, dtype=torch.int64)
            return super().state_dict()

        def load_state_dict(self, state_dict) -> None:
            """The tables' step is checked before anything changes: an int tensor >= 0."""
            if not isinstance(state_dict, dict):
                raise TypeError(f"state_dict must be a dict (from state_dict()), got {type(state_dict).__name__}")
            entry = state_dict.get("state")
            entry = entry.get(key) if isinstance(entry, dict) else None
            step = entry.get("step") if isinstance(entry, dict) else None
            if (not isinstance(step, torch.Tensor) or step.is_meta or step.numel() != 1
                    or step.is_floating_point() or step.dtype == torch.bool or not 0 <= int(step) < 2**63):
                raise ValueError(f"state_dict['state'][{key!r}]['step'] must be an int tensor >= 0 (as state_dict() "
                                 f"writes it), got {step!r}")
            super().load_state_dict(state_dict)
            for store in self._stores:
                store.step = int(step)

    return KeyedFusedOptimizer()
