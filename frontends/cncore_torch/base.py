"""`TableModule`: the one base of every module over dynamic tables, the `nn.Embedding`-like
modules (`cncore_torch.modules`) and the TorchRec collections (`cncore_torch.collection`).

What they share is what they are to the bridge (`cncore_torch.bridge`) and to `state_dict`:

- an anchor: a zero-size parameter every lookup takes, so autograd always runs the lookup's
  backward (where the rows are updated) and optimizers find the module;
- a handle (`bridge.register`) by which the `cncore::` operators name the module; handles are
  per process, so unpickling makes a new one. Building (or unpickling) the first module
  registers the operators (`cncore_torch.ops.register_operators`);
- `_lookup_tables()`: the table each feature of its lookup reads, in order (the bridge reads it);
- `_tables(prefix)`: its tables in a state_dict (`cncore_torch.state.TableSpec`), which
  `_load_tables` loads all or nothing, the rest of the entries going to `nn.Module`.

Also the checks both spell alike: `store_config` (a `cncore.StoreConfig` whose errors name
the module's arguments), `check_flag`, and `check_unsharded_world` (a collection left unsharded
in a process group of several ranks).
"""
from __future__ import annotations

import sys
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn

import cncore
from cncore_torch import bridge
from cncore_torch.ops import register_operators
from cncore_torch.state import load_tables

__all__ = ["TableModule", "store_config", "check_flag", "check_unsharded_world"]


def store_config(context: str, embedding_dim, **fields) -> cncore.StoreConfig:
    """`cncore.StoreConfig(dim=embedding_dim, **fields)`, its errors naming our arguments (the
    core calls embedding_dim `dim`), after `context` (say, which table)."""
    try:
        return cncore.StoreConfig(dim=embedding_dim, **fields)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise type(exc)(context + ("embedding_" + message if message.startswith("dim ") else message)) from None


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_unsharded_world(owner: str, sharder: str, per_rank_tables: bool) -> None:
    """Refuse a collection running unsharded in a process group of more than one rank (DMP
    without our sharder, or DDP): each rank would train its own copy of every table, and the
    copies would drift apart silently. `per_rank_tables=True` says each rank owns a separate
    table on purpose.

    Args:
        owner: the collection's class name.
        sharder: the name of its sharder in `cncore_torch.distributed`.
        per_rank_tables: the collection's opt-in.

    Returns:
        None; raises RuntimeError in a group of several ranks without the opt-in.

    >>> check_unsharded_world("CNEmbeddingBagCollection", "CNEmbeddingBagCollectionSharder", False)  # no group
    """
    if per_rank_tables or not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world > 1:
        raise RuntimeError(
            f"{owner} runs unsharded in a process group of {world} ranks: each rank would train its own copy of "
            f"every table, and the copies drift apart silently. Shard it: DistributedModelParallel(model, "
            f"sharders=[cncore_torch.distributed.{sharder}()]); or, if each rank owns a separate table on purpose, "
            f"build it with per_rank_tables=True")


class TableModule(nn.Module):
    """The base of the modules and the collections (see the module docstring). Subclasses call
    `_init_lookup` in their constructor and define `_lookup_tables` and `_tables`."""

    def _init_lookup(self, anchor_shape: tuple, device) -> None:
        """The anchor parameter (zero elements of `anchor_shape`, on `device`) and the handle."""
        self._anchor = nn.Parameter(torch.empty(anchor_shape, device=device))
        register_operators()
        self._handle = bridge.register(self)

    def _lookup_tables(self) -> list:
        """The table (a store or DeviceRows) of each feature the lookup reads, in order."""
        raise NotImplementedError

    def _tables(self, prefix: str) -> dict:
        """{state_dict prefix: (its StoreConfig, what loads a checked TableState into it)}."""
        raise NotImplementedError

    # --- torch.ao quantization, as TorchRec's inference quantizers drive it ----------------------
    # quantize_embeddings / quantize_inference_model swap TorchRec's own classes only: a model
    # holding ours would come back with its tables untouched. Both set `qconfig` on every
    # module before swapping, which is where ours refuse; other torch.ao callers (say,
    # quantize_dynamic of the dense Linear layers) set it too and go through.

    @property
    def qconfig(self):
        return self.__dict__.get("_qconfig")

    @qconfig.setter
    def qconfig(self, value) -> None:
        caller = _torchrec_quantizer()
        if caller is not None:
            raise TypeError(f"{caller}: {type(self).__name__} holds dynamic tables, which TorchRec's quantizer "
                            f"cannot read (it would return them unquantized); freeze the model first, "
                            f"cncore_torch.serving.freeze(model), and quantize the frozen copy (docs/serving.md)")
        self.__dict__["_qconfig"] = value

    @qconfig.deleter
    def qconfig(self) -> None:
        self.__dict__.pop("_qconfig", None)

    def __prepare_scriptable__(self):
        """`torch.jit.script` (which calls this on every module it compiles): refused, naming
        what compiles instead; the rows live in a dynamic table TorchScript cannot reach."""
        raise TypeError(f"torch.jit.script cannot compile {type(self).__name__}: its rows live in a dynamic table "
                        "outside TorchScript; use torch.compile or torch.export (docs/torchrec.md), or "
                        "cncore_torch.serving.freeze(model) for a copy in plain torch")

    def __setstate__(self, state):
        super().__setstate__(state)
        register_operators()
        self._handle = bridge.register(self)  # handles are per process

    def _load_rest(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
        """The entries that are not tables (the anchor, submodules' parameters), as nn.Module loads them."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _load_tables(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
        """All or nothing (see cncore_torch.state): every table of `_tables(prefix)` is checked
        before any changes; the other entries go to `_load_rest`."""
        def load_rest(rest, missing, unexpected, errors):
            self._load_rest(rest, prefix, local_metadata, strict, missing, unexpected, errors)

        load_tables(self._tables(prefix), load_rest, state_dict, missing_keys, unexpected_keys, error_msgs)


def _torchrec_quantizer() -> str | None:
    """The name of the outermost TorchRec inference quantizer on the call stack (the one the
    user called; None: not called by one)."""
    frame: FrameType | None = sys._getframe(2)
    found = None
    while frame is not None:
        if (frame.f_globals.get("__name__") == "torchrec.inference.modules"
                and frame.f_code.co_name in ("quantize_embeddings", "quantize_inference_model")):
            found = f"torchrec.inference.modules.{frame.f_code.co_name}"
        frame = frame.f_back
    return found
