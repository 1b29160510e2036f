"""The core's 64-bit hashes and row initialiser as torch ops, so that they run on any device.

Unsigned 64-bit arithmetic is spelled with int64 tensors: additions and multiplications wrap
mod 2**64 in two's complement (as the core's uint64_t does), and a logical right shift is an
arithmetic shift with the sign bits masked off. Every function here gives the same bits as its
C counterpart (`cn_mix.h`, `cn_admit.h`, `cn_init.h`); the tests compare them on int64 extremes.
"""
from __future__ import annotations

import numpy as np
import torch

import cncore

__all__ = ["mix64", "admission_draw", "sketch_columns", "initial_rows", "initializes_on_device"]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _s64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (`cn_mix64`) of int64 tensors, bit for bit.

    Args:
        z: int64 tensor of any shape and device.

    Returns:
        int64 tensor of the same shape: the mixed bits.

    >>> mix64(torch.tensor([0, 1])).tolist()
    [0, 6238072747940578789]
    """
    z = (z ^ _shr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _s64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def admission_draw(keys: torch.Tensor, seed: int, threshold: int) -> torch.Tensor:
    """`cncore.Probability`'s rule (`cn_admit_draw`): True where a key is admitted."""
    salt = _s64(int(mix64(torch.tensor(_s64(seed ^ 0xD1B54A32D192ED03))).item()))
    return _shr(mix64(keys ^ salt), 11) < threshold


def sketch_columns(keys: torch.Tensor, depth: int, width: int) -> torch.Tensor:
    """(depth, N) column of each key in each row of `cncore.MinCount`'s count-min sketch
    (`cn_admit_counter`: mix64(key + (i + 1) * golden) mod width)."""
    rows = [mix64(keys + _s64((i + 1) * _GOLDEN)) & (width - 1) for i in range(depth)]
    return torch.stack(rows) if rows else keys.new_empty((0, len(keys)))


def _draw32(stream: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """`cn_draw32`: a 32-bit draw (held in int64) for each (row stream, column counter)."""
    h = ((stream & 0xFFFFFFFF) + counter * 0x9E3779B9) & 0xFFFFFFFF
    h = h ^ _shr(stream, 32)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def initializes_on_device(initializer) -> bool:
    """Whether `initial_rows` computes this initialiser's rows with torch ops on the rows' device
    (Uniform and Constant, bit for bit); the normal laws are drawn by the core on the host (its
    branch-free logf and cos polynomials, cn_init.h, are not written again here)."""
    return isinstance(initializer, (cncore.Uniform, cncore.Constant))


def initial_rows(config: cncore.StoreConfig, keys: torch.Tensor) -> torch.Tensor:
    """The rows a core store with `config` gives `keys` when it inserts them, on `keys`' device.

    Uniform and Constant are computed there with torch ops (no host copy); Normal and
    TruncatedNormal by `cncore.initial_rows` on the host (the keys go to the host, their rows
    come back). Either way the rows equal the core's bit for bit.

    Args:
        config: the table's `cncore.StoreConfig` (its `initializer`, `seed` and `dim`).
        keys: (N,) int64 tensor.

    Returns:
        (N, dim) float32 tensor on `keys.device`.

    >>> cfg = cncore.StoreConfig(dim=2, seed=3, initializer=cncore.Uniform(-1.0, 1.0))
    >>> keys = torch.tensor([5, -2**63])
    >>> bool((initial_rows(cfg, keys).numpy() == cncore.initial_rows(cfg, keys.numpy())).all())
    True
    """
    init, dim = config.initializer, config.dim
    if isinstance(init, cncore.Constant):
        return torch.full((len(keys), dim), float(init.value), dtype=torch.float32, device=keys.device)
    if not isinstance(init, cncore.Uniform):
        host = cncore.initial_rows(config, keys.detach().cpu().numpy().astype(np.int64, copy=False))
        return torch.from_numpy(host).to(keys.device)
    stream = mix64(mix64(keys) ^ _s64(config.seed * _GOLDEN + 0x632BE59BD9B4E019))
    bits = _draw32(stream[:, None], torch.arange(dim, device=keys.device)[None, :])
    unit = (bits >> 8).to(torch.float32) * (1.0 / 16777216.0)
    low = torch.tensor(init.low, dtype=torch.float32)
    span = torch.tensor(init.high, dtype=torch.float32) - low
    # low + span * u in float32, the product rounded and then the sum, as the core computes it
    # (cn_init.h compiles the initialiser without fused multiply-adds).
    return low.to(keys.device) + span.to(keys.device) * unit
