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
from collections.abc import Callable
from typing import Any, Protocol, overload

import torch

from cncore.config import Optimizer

__all__ = ["FusedOptimizer"]


class StepHolder(Protocol):
    """What the optimizer reads and sets on a table's storage: its optimizer step."""
    step: int


class FusedOptimizer(torch.optim.Optimizer):
    """The optimizer a table applies inside its backward (see the module docstring): a
    module's or collection's `fused_optimizer`, built by it, not by hand.

    Args:
        anchor (torch.nn.Parameter): the module's zero-size parameter, the one entry of
            `param_groups` (whose "lr" is the learning rate the backward applies).
        config (cncore.Optimizer): the table's optimizer (`cncore.SGD`, `Adagrad`, ...).
        store_ref (Callable[[], StepHolder | None]): returns the table's storage, or None
            before it is materialised.

    Example::

        >>> import cncore
        >>> from cncore_torch import CNEmbedding
        >>> opt = CNEmbedding(10, 2, optimizer=cncore.Adagrad(lr=0.1)).fused_optimizer
        >>> opt.lr, opt.state_dict()
        (0.1, {'lr': 0.1, 'step': 0, 'optimizer': 'Adagrad'})
    """

    def __init__(self, anchor: torch.nn.Parameter, config: Optimizer,
                 store_ref: Callable[[], StepHolder | None]) -> None:
        self._config = config
        self._store_ref = store_ref  # a callable returning the store (or None before materialisation)
        super().__init__([anchor], {"lr": config.lr})

    @property
    def lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Nothing to do: the rows were updated in backward. Runs `closure` if given.

        Args:
            closure (Callable[[], float] | None): re-evaluates the model and returns the loss.

        Returns:
            float | None: the closure's loss, or None without one.
        """
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: a fused table keeps no gradient.

        Args:
            set_to_none (bool): accepted as `torch.optim.Optimizer.zero_grad` takes it.
        """

    def state_dict(self) -> dict[str, Any]:
        """The learning rate, the table's step and the optimizer's name.

        Returns:
            dict[str, Any]: {"lr": float, "step": int, "optimizer": str}.
        """
        store = self._store_ref()
        return {"lr": self.lr, "step": store.step if store is not None else 0,
                "optimizer": type(self._config).__name__}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checked whole before anything changes: the optimizer's name, lr a finite number >= 0,
        step an int >= 0.

        Args:
            state_dict (dict[str, Any]): what `state_dict()` returned.
        """
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
                           {"weight_decay": 0, "amsgrad": False, "maximize": False, "decoupled_weight_decay": False},
                           {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}),
    }
    try:
        from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
        table[TorchRecRowWiseAdagrad] = (cncore.RowWiseAdagrad,
                                         {"lr": "lr", "eps": "eps",
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
    TorchRec's placeholder classes (`torchrec.optim.SGD`, `Adagrad`, `Adam`: kwargs in FBGEMM's
    names, only meant for sharded tables) are read as TorchRec's sharders read them, through
    `optimizer_from_fused_params`.

    >>> optimizer_from_torch(torch.optim.Adagrad, {"lr": 0.1})
    Adagrad(lr=0.1, eps=1e-10, initial_accumulator_value=0.0)
    >>> optimizer_from_torch(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    Traceback (most recent call last):
    ...
    ValueError: apply_optimizer_in_backward: torch.optim.SGD with momentum=0.9 has no fused form on dynamic tables (only momentum=0); pass optimizer= a cncore optimizer instead
    """  # noqa: E501 (a doctest's expected error message is one line)
    placeholder = _torchrec_placeholders().get(optimizer_class)
    if placeholder is not None:
        params = dict(kwargs or {})
        if "lr" in params:  # as torchrec.distributed.utils.merge_fused_params renames it
            params["learning_rate"] = params.pop("lr")
        return optimizer_from_fused_params({"optimizer": placeholder, **params},
                                           f"{where}: torchrec.optim.{optimizer_class.__name__}")
    table = _torch_optimizers()
    if optimizer_class not in table:
        names = ", ".join([f"{c.__module__.split('.')[0]}.optim.{c.__name__}" for c in table]
                          + [f"torchrec.optim.{c.__name__}" for c in _torchrec_placeholders()])
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


def _torchrec_placeholders() -> dict:
    """{TorchRec's placeholder optimizer class: its FBGEMM optimizer type} (empty without TorchRec)."""
    try:
        import torchrec.optim as trec_optim
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
    except ImportError:
        return {}
    return {trec_optim.SGD: EmbOptimType.EXACT_SGD, trec_optim.Adagrad: EmbOptimType.EXACT_ADAGRAD,
            trec_optim.Adam: EmbOptimType.ADAM}


# FBGEMM's fused_params (what TorchRec's sharders take), with FBGEMM's defaults.
_FBGEMM_FIELDS = {"learning_rate": 0.01, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999}
_FBGEMM_ONLY = {"weight_decay": 0.0}


def optimizer_from_fused_params(fused_params: dict | None, where: str = "fused_params"):
    """The cncore optimizer of FBGEMM-style fused params, as TorchRec's sharders take them
    (`EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "learning_rate": 0.05})`), with FBGEMM's defaults (learning_rate 0.01, eps 1e-8, beta1 0.9,
    beta2 0.999); None for no params. EXACT_SGD/SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD/
    ROWWISE_ADAGRAD and ADAM have fused forms; any other optimizer or key is refused by name
    (dynamic tables have no cache, precision or prefetch options to set that way).

    >>> from fbgemm_gpu.split_embedding_configs import EmbOptimType
    >>> optimizer_from_fused_params({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    RowWiseAdagrad(lr=0.05, eps=1e-08, initial_accumulator_value=0.0)
    >>> optimizer_from_fused_params({"optimizer": EmbOptimType.ADAM, "cache_load_factor": 0.2})
    Traceback (most recent call last):
    ...
    ValueError: fused_params: 'cache_load_factor' has no meaning for dynamic tables (they read optimizer, learning_rate, eps, beta1, beta2, and weight_decay=0)
    """  # noqa: E501 (a doctest's expected error message is one line)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    import cncore

    if not fused_params:
        return None
    if not isinstance(fused_params, dict):
        raise TypeError(f"{where} must be a dict, got {type(fused_params).__name__}")
    known = ", ".join(["optimizer", *_FBGEMM_FIELDS]) + ", and weight_decay=0"
    for name, value in fused_params.items():
        if name == "optimizer" or name in _FBGEMM_FIELDS:
            continue
        if name not in _FBGEMM_ONLY:
            raise ValueError(f"{where}: {name!r} has no meaning for dynamic tables (they read {known})")
        if value != _FBGEMM_ONLY[name]:
            raise ValueError(f"{where}: {name}={value!r} has no fused form on dynamic tables (only "
                             f"{name}={_FBGEMM_ONLY[name]!r})")
    kind = fused_params.get("optimizer")
    if kind is None:
        raise ValueError(f"{where}: {sorted(fused_params)} set no 'optimizer' (an fbgemm_gpu EmbOptimType)")
    v = {**_FBGEMM_FIELDS, **{k: fused_params[k] for k in _FBGEMM_FIELDS if k in fused_params}}
    lr = float(v["learning_rate"]) if isinstance(v["learning_rate"], torch.Tensor) else v["learning_rate"]
    if kind in (EmbOptimType.EXACT_SGD, EmbOptimType.SGD):
        return cncore.SGD(lr=lr)
    if kind == EmbOptimType.EXACT_ADAGRAD:
        return cncore.Adagrad(lr=lr, eps=v["eps"])
    if kind in (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ROWWISE_ADAGRAD):
        return cncore.RowWiseAdagrad(lr=lr, eps=v["eps"])
    if kind == EmbOptimType.ADAM:
        return cncore.Adam(lr=lr, betas=(v["beta1"], v["beta2"]), eps=v["eps"])
    raise ValueError(f"{where}: optimizer {kind!r} cannot run fused on dynamic tables; use EXACT_SGD, "
                     "EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD or ADAM, or pass optimizer= a cncore optimizer")


def optimizer_tag(param: torch.nn.Parameter):
    """What `apply_optimizer_in_backward` attached to `param`, as a comparable value (None if
    nothing): a later call on the same parameter changes it."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs = getattr(param, "_optimizer_kwargs", [{}] * len(classes))
    return tuple(classes), tuple(tuple(sorted(dict(k).items(), key=lambda kv: kv[0])) for k in kwargs)


def in_backward_optimizer(param: torch.nn.Parameter, where: str, sharded: bool = False):
    """The cncore optimizer `apply_optimizer_in_backward` attached to `param`, or None.
    TorchRec's placeholder optimizers (`torchrec.optim.SGD`, ...) only where `sharded`: on a
    collection in one process torch's backward hook calls their `step`, which raises."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs = getattr(param, "_optimizer_kwargs", [{}] * len(classes))
    if len(classes) != 1:
        raise ValueError(f"{where}: apply_optimizer_in_backward was called {len(classes)} times on its parameters "
                         f"({', '.join(c.__name__ for c in classes)}); dynamic tables take one optimizer, as "
                         "TorchRec's fused tables do")
    if not sharded and classes[0] in _torchrec_placeholders():
        raise ValueError(f"{where}: torchrec.optim.{classes[0].__name__} is a placeholder only sharded tables take "
                         "(torch's backward hook calls its step, which raises NotImplementedError); use "
                         f"torch.optim.{classes[0].__name__} here, or shard the collection with DMP")
    return optimizer_from_torch(classes[0], dict(kwargs[0]), f"{where}: apply_optimizer_in_backward")


def resolve_optimizer(given, param: torch.nn.Parameter, where: str, fused_params: dict | None = None,
                      sharded: bool = False):
    """The one cncore optimizer of a collection's tables, from each place it can be set:
    `optimizer=` (`given`), `apply_optimizer_in_backward` on `param`, and (when `sharded`) the
    sharder's `fused_params`. The places that set one must agree (TorchRec would let a tag
    override fused_params key by key; two different optimizers for the same rows is more likely
    a mistake than a wish), else a ValueError names them; None when none does."""
    found = []
    if given is not None:
        found.append(("optimizer=", given))
    tagged = in_backward_optimizer(param, where, sharded)
    if tagged is not None:
        found.append(("apply_optimizer_in_backward", tagged))
    from_sharder = optimizer_from_fused_params(fused_params, f"{where}: the sharder's fused_params")
    if from_sharder is not None:
        found.append(("the sharder's fused_params", from_sharder))
    for source, optimizer in found[1:]:
        if optimizer != found[0][1]:
            raise ValueError(f"{where}: {found[0][0]} sets {found[0][1]!r} but {source} sets {optimizer!r}; its "
                             "tables train with one optimizer: set it one way (or the same in both). Nothing "
                             "was changed")
    return found[0][1] if found else None


def changed_optimizer_error(where: str, current, param: torch.nn.Parameter) -> ValueError:
    classes = getattr(param, "_optimizer_classes", None) or []
    return ValueError(
        f"{where}: its tables already train with {current!r}, and apply_optimizer_in_backward has since "
        f"tagged its parameters with {', '.join(c.__name__ for c in classes) or 'nothing'}; the optimizer of "
        "tables cannot change once they have it (each row's optimizer state is laid out for it). Build a "
        "new collection for another optimizer. The tables are unchanged")


def no_optimizer_error(owner: str) -> RuntimeError:
    return RuntimeError(
        f"{owner} has no optimizer, and a torch.optim optimizer over model.parameters() cannot train its "
        "rows (they are not parameters). Either build it with optimizer=cncore.RowWiseAdagrad(lr=...) (or "
        "SGD, Adagrad, Adam), or call torchrec.optim.apply_optimizer_in_backward(optimizer_class, "
        "<its parameters>, {\"lr\": ...}) before training, as for TorchRec's fused tables. (A forward "
        "needs neither, nor does a frozen collection: requires_grad_(False).)")
