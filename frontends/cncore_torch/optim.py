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
    """The fused optimizer of a TorchRec-style collection as a TorchRec `KeyedOptimizer`
    (`cncore_torch.keyed_optim.KeyedFusedOptimizer`)."""
    from cncore_torch.keyed_optim import KeyedFusedOptimizer
    return KeyedFusedOptimizer(anchor, config, stores, key)


# --- TorchRec's apply_optimizer_in_backward, mapped onto the core's fused optimizers ---------------
#
# apply_optimizer_in_backward(optimizer_class, params, kwargs) tags each parameter with
# `_optimizer_classes` / `_optimizer_kwargs` (torch.distributed.optim), which TorchRec's own
# sharders read to build their fused kernels; the collections read them from their anchor the
# same way. Each torch option is taken only where the core computes the same thing; any other
# value is refused by name rather than ignored.

def _torch_optimizers() -> dict:
    """{optimizer class: (cncore class, {torch kwarg: cncore field}, {torch kwarg: the only value
    accepted}, {cncore field: torch's default})}."""
    import cncore
    table = {
        torch.optim.SGD: (cncore.SGD, {"lr": "lr"},
                          {"momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False, "maximize": False},
                          {"lr": 1e-3}),
        torch.optim.Adagrad: (cncore.Adagrad, {"lr": "lr", "eps": "eps",
                                               "initial_accumulator_value": "initial_accumulator_value"},
                              {"lr_decay": 0, "weight_decay": 0, "maximize": False},
                              {"lr": 1e-2, "eps": 1e-10, "initial_accumulator_value": 0.0}),
        torch.optim.Adam: (cncore.Adam, {"lr": "lr", "betas": "betas", "eps": "eps"},
                           {"weight_decay": 0, "amsgrad": False, "maximize": False},
                           {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}),
    }
    try:
        from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
        table[TorchRecRowWiseAdagrad] = (cncore.RowWiseAdagrad, {"lr": "lr", "eps": "eps",
                                                                 "initial_accumulator_value": "initial_accumulator_value"},
                                         {"lr_decay": 0, "weight_decay": 0, "maximize": False},
                                         {"lr": 1e-2, "eps": 1e-10, "initial_accumulator_value": 0.0})
    except ImportError:  # TorchRec is optional for the modules
        pass
    return table


# Options that change how, not what, torch computes: accepted with any value.
_HOW = ("foreach", "fused", "differentiable", "capturable")


def optimizer_from_torch(optimizer_class, kwargs: dict, where: str = "apply_optimizer_in_backward"):
    """The cncore optimizer that computes what `optimizer_class(**kwargs)` computes on the rows a
    batch touches (Adam lazily: rows without a gradient keep their moments, as in FBGEMM).

    >>> optimizer_from_torch(torch.optim.Adagrad, {"lr": 0.1})
    Adagrad(lr=0.1, eps=1e-10, initial_accumulator_value=0.0)
    >>> optimizer_from_torch(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    Traceback (most recent call last):
    ...
    ValueError: apply_optimizer_in_backward: torch.optim.SGD with momentum=0.9 has no fused form on dynamic tables (only momentum=0); pass optimizer= a cncore optimizer instead
    """
    table = _torch_optimizers()
    if optimizer_class not in table:
        names = ", ".join(f"{c.__module__.split('.')[0]}.optim.{c.__name__}" for c in table)
        raise ValueError(f"{where}: {getattr(optimizer_class, '__name__', optimizer_class)!r} cannot run fused on "
                         f"dynamic tables; use one of {names}, or pass optimizer= a cncore optimizer")
    cls, fields, only, defaults = table[optimizer_class]
    label = f"{optimizer_class.__module__.split('.')[0]}.optim.{optimizer_class.__name__}"
    values = dict(defaults)
    for name, value in (kwargs or {}).items():
        if name in fields:
            values[fields[name]] = tuple(value) if name == "betas" else value
        elif name in only:
            if value != only[name]:
                raise ValueError(f"{where}: {label} with {name}={value!r} has no fused form on dynamic tables "
                                 f"(only {name}={only[name]!r}); pass optimizer= a cncore optimizer instead")
        elif name not in _HOW:
            raise ValueError(f"{where}: {label} has no option {name!r} that dynamic tables know")
    if isinstance(values["lr"], torch.Tensor):
        values["lr"] = float(values["lr"])
    return cls(**values)


def in_backward_optimizer(param: torch.nn.Parameter, where: str):
    """The cncore optimizer `apply_optimizer_in_backward` attached to `param`, or None."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs = getattr(param, "_optimizer_kwargs", [{}] * len(classes))
    if len(classes) != 1:
        raise ValueError(f"{where}: apply_optimizer_in_backward attached {len(classes)} optimizers to its "
                         "parameters; dynamic tables take one")
    return optimizer_from_torch(classes[0], dict(kwargs[0]), f"{where}: apply_optimizer_in_backward")


def no_optimizer_error(owner: str) -> RuntimeError:
    return RuntimeError(
        f"{owner} has no optimizer, and a torch.optim optimizer over model.parameters() cannot train its "
        "rows (they are not parameters). Either build it with optimizer=cncore.RowWiseAdagrad(lr=...) (or "
        "SGD, Adagrad, Adam), or call torchrec.optim.apply_optimizer_in_backward(optimizer_class, "
        "<its parameters>, {\"lr\": ...}) before training, as for TorchRec's fused tables. (Forward under "
        "torch.no_grad() or in eval mode needs neither.)")
