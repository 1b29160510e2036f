"""Rows in accelerator memory (the "cncard" placement): the core keeps the key index on the
host; rows, optimizer state and access metadata are tensors on the device; lookups and
updates are PyTorch ops over the slots the core returns.

Device row 0 is a permanent zero row: slot s lives at row s + 1, and a key unseen in
evaluation reads row 0. Growth reallocates the tensors (doubling) and copies the rows over.

Bounded tables (max_rows, eviction, admission): the policy runs in the host index, which is a
bounded store with the table's policy, so eviction order, ties, admission counts and the
budget are the core's, exactly as for rows in the core. For that the index must see what the
core store sees:
- access metadata: every training backward records count += occurrences and last step in
  the index as well as on the device (the index's copy drives LRU/LFU/TTL; the device's is
  what exports read, and the two are equal);
- the step: the index's step follows the device rows' optimizer step (TTL sweeps read it);
- which device row an evicted key held: the index's (otherwise unused) 2-float row holds the
  slot number as two exact floats (low 20 bits, the rest), because the core hands evicted rows
  over after it has freed their slots, and a slot may be refilled in the same call. The sink
  runs inside that call, before this class writes the new keys' rows, so the evicted keys'
  device rows, state and metadata are still intact when they are copied out.
A lookup context of device rows, like one of the core, is refused in backward when rows were
evicted since its forward (their device rows may hold other keys by then). Admission: a key
not admitted reads the zero row (MinCount(unadmitted="initial") is refused here for now: its
initial row would need a row of its own for the pooling).

The key index on the device (`key_index="device"`, or CNCORE_DEVICE_INDEX=device for every
table built without the argument): `DeviceIndexedRows`, the same rows with a
`cncore_torch.device_index.DeviceKeyIndex` beside them on the device instead of the host
index, so a step's find, insert, admission, eviction and access records run as torch ops
there (docs/design/device-index.md). Its slots, evicted keys and their order equal the
host index's; the keys go to the host only for the normal initialisers' new rows, eviction
sinks, exports and writes.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

import cncore
from cncore import _core
from cncore._interchange import as_keys
from cncore.config import with_default_split
from cncore.store import config_with_optimizer
from cncore_torch.device_index import DeviceKeyIndex, EvictedSlots, initial_rows
from cncore_torch.device_index.segments import join_row_gradients, pooled_row_gradients

KEY_INDEXES = ("host", "device")

_MODES = ("sum", "mean", "max")
_SLOT_SPLIT = 1 << 20  # a slot number as two floats, each an integer below 2**24 (exact)


def _encode_slots(slots: np.ndarray) -> np.ndarray:
    return np.stack([slots % _SLOT_SPLIT, slots // _SLOT_SPLIT], axis=1).astype(np.float32)


def _decode_slots(rows: np.ndarray) -> np.ndarray:
    return rows[:, 0].astype(np.int64) + rows[:, 1].astype(np.int64) * _SLOT_SPLIT


@dataclasses.dataclass(frozen=True)
class DeviceLookup:
    """What the backward of a lookup on device rows needs."""
    rows_idx: torch.Tensor   # device row of every ID (0: the zero row)
    offsets: torch.Tensor    # B+1, on the device
    weights: object          # per-ID weights on the device, or None
    mode: int
    training: bool
    step: int                # the rows' step at the lookup (recorded as last step)
    evictions: int           # eviction events before the lookup (a later one makes it stale)


def key_index_choice(key_index: str | None) -> str:
    """Where a table's key index lives: `key_index`, else CNCORE_DEVICE_INDEX, else "host"."""
    source = "key_index"
    if key_index is None:
        key_index, source = os.environ.get("CNCORE_DEVICE_INDEX", "host"), "CNCORE_DEVICE_INDEX"
    if key_index not in KEY_INDEXES:
        raise ValueError(f"{source}={key_index!r}: expected 'host' (the core's index on the host) or 'device' "
                         "(cncore_torch.device_index on the rows' device)")
    return key_index


def lookup_features(tables: list, keys: list, offsets: list, weights: list, modes: list[int], training: bool
                    ) -> tuple[list[torch.Tensor], list[DeviceLookup]]:
    """Every feature's lookup on device rows: (pooled rows, context) per feature. A table that
    several features read resolves their keys in one call, in feature order (as the core's
    grouped lookup does), so an eviction that one feature's new keys cause never removes a row
    another feature of the same call read."""
    rows_of_feature: dict[int, torch.Tensor] = {}
    by_table: dict[int, list[int]] = {}
    for f, table in enumerate(tables):
        by_table.setdefault(id(table), []).append(f)
    for features in by_table.values():
        if len(features) > 1:
            table = tables[features[0]]
            joined = torch.cat([torch.as_tensor(keys[f]).to(table.device, torch.int64) for f in features])
            rows_idx = table.resolve(joined, training)
            sizes = [len(keys[f]) for f in features]
            rows_of_feature.update(zip(features, torch.split(rows_idx, sizes)))
    outs, ctxs = [], []
    for f, (table, k, o, w, m) in enumerate(zip(tables, keys, offsets, weights, modes)):
        out, ctx = table.lookup(k, o, w, m, training, rows_of_feature.get(f))
        outs.append(out)
        ctxs.append(ctx)
    return outs, ctxs


class DeviceRows:
    """Rows on an accelerator with the key index in the core on the host (`key_index="host"`),
    or, built with `key_index="device"`, a `DeviceIndexedRows` (the index on the device too)."""

    def __new__(cls, *args, **kwargs):
        # (copy and pickle call __new__ without arguments: they rebuild the class they saved)
        if cls is DeviceRows and args:
            key_index = kwargs.get("key_index", args[2] if len(args) > 2 else None)
            if key_index_choice(key_index) == "device":
                return super().__new__(DeviceIndexedRows)
        return super().__new__(cls)

    def __init__(self, config: cncore.StoreConfig, device: torch.device, key_index: str | None = None):
        config = with_default_split(config, can_split=False)  # the default on an accelerator: one row per key
        if config.fallback_rows:
            raise ValueError(f"fallback_rows={config.fallback_rows}: rows on an accelerator keep no fallback rows; "
                             "keep this table on device='cpu' (the core), or set fallback_rows=0")
        self.config = config
        self.device = device
        admission = config.admission
        if admission is not None and getattr(admission, "unadmitted", "zeros") != "zeros":
            raise ValueError(f"admission={admission!r}: rows on an accelerator read keys not admitted as zeros; "
                             "pass unadmitted='zeros', or keep this table on device='cpu' (the core)")
        self.bounded = config.eviction is not None or config.admission is not None or config.max_rows is not None
        # The index: a store whose rows the lookups never read (the rows live on the device). A
        # bounded table's index carries the policy, and its 2-float rows the device slot (above).
        self.index = cncore.EmbeddingStore(cncore.StoreConfig(
            dim=2 if self.bounded else 1, capacity=config.capacity, max_load_factor=config.max_load_factor,
            initializer=cncore.Constant(0.0), seed=config.seed, max_rows=config.max_rows,
            eviction=config.eviction, admission=config.admission, headroom=config.headroom,
            fallback_rows=0))  # an index: a slot per key, never shared
        self._evict_callbacks: list[Callable] = []
        self.evictions = 0  # eviction events: a lookup context from before one is refused in backward
        if self.bounded:
            self.index.on_evict(self._evicted)
        self._step = 0
        cap = max(16, config.capacity + 1)
        self.rows = torch.zeros(cap, config.dim, device=device)
        self.state = torch.zeros(cap, config.state_floats, device=device)
        self.counts = torch.zeros(cap, dtype=torch.int64, device=device)
        self.last_steps = torch.zeros(cap, dtype=torch.int64, device=device)
        self.slot_keys = torch.zeros(cap, dtype=torch.int64)  # host: row -> key, for gradients and export

    def __len__(self):
        return len(self.index)

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def nbytes(self) -> int:
        """Bytes held: the device tensors (rows, optimizer state, metadata), the host row -> key
        map and the host index."""
        return sum(t.numel() * t.element_size() for t in (self.rows, self.state, self.counts, self.last_steps,
                                                           self.slot_keys)) + self.index.nbytes

    def set_optimizer(self, optimizer) -> None:
        """As `EmbeddingStore.set_optimizer`: a table built without an optimizer gets one; rows,
        metadata and the step stay, each row starting from the optimizer's initial state."""
        config = config_with_optimizer(self.config, optimizer)
        self.state = torch.full((self.rows.shape[0], config.state_floats), float(optimizer.initial_state),
                                device=self.device)
        self.config = config

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self.index.step = int(value)  # TTL sweeps and the index's view of "now"; it refuses a step past 2**32 - 1
        self._step = int(value)

    # --- bounded tables ---------------------------------------------------------------------------

    @property
    def evicted_count(self) -> int:
        """Rows evicted so far (settable, as `EmbeddingStore.evicted_count`)."""
        return self.index.evicted_count

    @evicted_count.setter
    def evicted_count(self, value) -> None:
        self.index.evicted_count = value

    def on_evict(self, callback) -> None:
        """Register `callback(batch)`: a `cncore.TableBatch` of every eviction's rows (keys, rows,
        optimizer state, counts, last steps; CPU NumPy arrays), as `EmbeddingStore.on_evict`."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        if not self.bounded:
            raise TypeError("on_evict: this table has no eviction policy (max_rows / eviction not set)")
        self._evict_callbacks.append(callback)

    def evict(self, n: int) -> int:
        """Evict the `n` lowest-scoring rows now (the table's policy); returns how many."""
        return self.index.evict(n)

    def evict_expired(self) -> int:
        """TTL: evict every row not seen for more than the TTL's steps; returns how many."""
        return self.index.evict_expired()

    def _evicted(self, batch) -> None:
        """The index evicted these keys: copy their device rows out before the slots are reused."""
        self.evictions += 1
        if not self._evict_callbacks:
            return
        at = torch.from_numpy(_decode_slots(batch.rows) + 1).to(self.device)
        out = cncore.TableBatch(batch.keys, self.rows[at].cpu().numpy(), self.state[at].cpu().numpy(),
                                self.counts[at].cpu().numpy().astype(np.uint32),
                                self.last_steps[at].cpu().numpy().astype(np.uint32), batch.found)
        for callback in list(self._evict_callbacks):
            callback(out)

    def _insert(self, host: np.ndarray, lookup: bool):
        """(slots, found) of keys, inserting the absent ones the policy admits (training
        lookups: admission counts them; explicit writes insert every key)."""
        if not (lookup and (self.config.admission is not None or self.config.max_rows is not None)):
            return self.index.find_or_insert(host)
        present = self.index.contains(host)
        # The core's own training lookup counts sightings, admits, evicts and inserts; its
        # pooled output (of the 2-float index rows) is not used.
        self.index.pooled_lookup(host, lengths=np.array([len(host)]), insert_missing=True)
        slots, found = self.index.find(host)
        slots = np.where(found, slots, -1)  # a key not admitted: the zero row
        return slots, present

    def _grow(self, rows_needed: int) -> None:
        cap = self.rows.shape[0]
        if rows_needed <= cap:
            return
        while cap < rows_needed:
            cap *= 2
        for name in ("rows", "state", "counts", "last_steps", "slot_keys"):
            old = getattr(self, name)
            new = old.new_zeros((cap,) + tuple(old.shape[1:]))
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def resolve(self, keys: torch.Tensor, training: bool, lookup: bool = True) -> torch.Tensor:
        """Device row of every key (inserting and initialising unseen keys when training; a
        training lookup goes through admission, an explicit write (`lookup=False`) does not)."""
        host = keys.detach().cpu().numpy()
        if training:
            slots, found = self._insert(host.astype(np.int64, copy=False), lookup)
            new = ~found & (slots >= 0)
            if new.any():
                new_slots, first = np.unique(slots[new], return_index=True)
                new_keys = host[new][first]
                if self.bounded:
                    self.index.assign(new_keys, _encode_slots(new_slots))
                self._grow(int(new_slots.max()) + 2)
                rows = torch.from_numpy(cncore.initial_rows(self.config, new_keys)).to(self.device)
                at = torch.from_numpy(new_slots + 1).to(self.device)
                self.rows[at] = rows
                self.state[at] = self.config.optimizer.initial_state if self.config.optimizer else 0.0
                self.counts[at] = 0
                self.last_steps[at] = 0
                self.slot_keys[torch.from_numpy(new_slots + 1)] = torch.from_numpy(new_keys)
        else:
            slots, _ = self.index.find(host)
        return torch.from_numpy(slots + 1).to(self.device)

    @staticmethod
    def _weighted_mean_as_sum(offsets, weights, mode: int):
        """torch's embedding_bag takes weights with "sum" only; weighted "mean" (the core's
        sum(w x) / len) is a weighted sum with w / len. Returns (mode, weights, 1/len per key)."""
        if weights is None or mode != 1:
            return mode, weights, None
        lengths = offsets[1:] - offsets[:-1]
        inv = (1.0 / lengths.clamp(min=1).to(weights.dtype)).repeat_interleave(lengths, output_size=len(weights))
        return 0, weights * inv, inv

    def pool(self, rows_idx, offsets, weights, mode: int):
        mode, weights, _ = self._weighted_mean_as_sum(offsets, weights, mode)
        return F.embedding_bag(rows_idx, self.rows, offsets, mode=_MODES[mode], per_sample_weights=weights,
                               include_last_offset=True)

    def gradients(self, rows_idx, offsets, weights, mode: int, grad_out):
        """(distinct device rows, their gradient, occurrences, d/d weights), the zero row left
        out: `device_index.segments`'s static-shape gradients (no autograd, so they run inside a
        compiled graph's operator too), compacted to the rows read, as the host index records
        each row's access once (a host read, which this path makes anyway)."""
        rows, grads, occurrences, grad_weights = pooled_row_gradients(self.rows, rows_idx, offsets, weights, mode,
                                                                      grad_out)
        keep = occurrences > 0
        return rows[keep], grads[keep], occurrences[keep], grad_weights

    def join_gradients(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One (row, gradient, occurrences) per distinct row of several lookups' `gradients`."""
        if len(parts) == 1:
            return parts[0]
        idx, inverse = torch.unique(torch.cat([p[0] for p in parts]), return_inverse=True)
        grads = torch.zeros((len(idx), self.dim), device=self.device).index_add_(0, inverse,
                                                                                  torch.cat([p[1] for p in parts]))
        occurrences = torch.zeros(len(idx), dtype=torch.int64, device=self.device).index_add_(
            0, inverse, torch.cat([p[2] for p in parts]))
        return idx, grads, occurrences

    def gradient_keys(self, idx: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, gradients) of the rows of `gradients` / `join_gradients`, for the gradient hooks."""
        return self.slot_keys[idx.cpu()], grads

    # --- the lookup and its backward (called by the bridge, cncore_torch/bridge.py) ----------------

    def lookup(self, keys: torch.Tensor, offsets: torch.Tensor, weights, mode: int, training: bool,
               rows_idx: torch.Tensor | None = None):
        """(pooled rows (B, dim) on the device, the context its backward needs); `rows_idx`:
        the keys' rows when `lookup_features` resolved them already."""
        if rows_idx is None:
            rows_idx = self.resolve(keys, training)
        offsets = offsets.to(self.device)
        weights = None if weights is None else weights.to(self.device)
        with torch.no_grad():
            out = self.pool(rows_idx, offsets, weights, mode)
        return out, DeviceLookup(rows_idx, offsets, weights, mode, training, self.step, self.evictions)

    def rows_of(self, ctx: DeviceLookup) -> torch.Tensor:
        """The rows the lookup read, one per ID (a key not admitted: the zero row)."""
        return self.rows[ctx.rows_idx]

    def check_fresh(self, ctx: DeviceLookup) -> None:
        """Whether the backward of `ctx` may run: checked for every table before any changes."""
        if self.evictions != ctx.evictions:
            raise RuntimeError("rows were evicted from this table since this lookup's forward, so its rows may "
                               "hold other keys now; run the backward before the next lookup that can evict")
        if self._step >= _core.STEP_MAX:
            raise ValueError(f"this table's step is {self._step} (2**32 - 1), the last step a row's 32-bit last_step "
                             f"records, and this backward would pass it; nothing was updated. {_core.STEP_REMEDY}")

    def record_access(self, idx, occurrences, step: int) -> None:
        self.counts[idx] = (self.counts[idx] + occurrences).clamp(max=2**32 - 1)
        self.last_steps[idx] = step
        if self.bounded:  # the policy reads the index's metadata
            at = idx.cpu()
            keys = self.slot_keys[at].numpy()
            self.index.load(keys, _encode_slots(at.numpy() - 1), None, self.counts[idx].cpu().numpy(),
                            np.full(len(keys), min(step, 2**32 - 1), np.int64))

    def apply(self, idx, g, lr: float) -> None:
        """The fused optimizer on rows idx with gradients g (same formulas as the core)."""
        opt = self.config.optimizer
        self.step = self._step + 1
        rows, state = self.rows, self.state
        if isinstance(opt, cncore.SGD):
            rows[idx] -= lr * g
        elif isinstance(opt, cncore.Adagrad):
            state[idx] += g * g
            rows[idx] -= lr * g / (state[idx].sqrt() + opt.eps)
        elif isinstance(opt, cncore.RowWiseAdagrad):
            state[idx, 0] += (g * g).mean(dim=1)
            rows[idx] -= (lr / (state[idx, 0].sqrt() + opt.eps))[:, None] * g
        elif isinstance(opt, cncore.Adam):
            b1, b2 = opt.betas
            d = self.config.dim
            m, v = state[idx, :d], state[idx, d:]
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            state[idx, :d], state[idx, d:] = m, v
            bias1, bias2 = 1 - b1 ** self.step, (1 - b2 ** self.step) ** 0.5
            rows[idx] -= (lr / bias1) * m / (v.sqrt() / bias2 + opt.eps)

    # --- moving rows in and out -----------------------------------------------------------------

    def export(self) -> cncore.TableBatch:
        """Every row, as `EmbeddingStore.export` gives them (host NumPy arrays)."""
        keys = self.index.export().keys
        slots, _ = self.index.find(keys)
        at = torch.from_numpy(slots + 1).to(self.device)
        return cncore.TableBatch(keys, self.rows[at].cpu().numpy(), self.state[at].cpu().numpy(),
                                 self.counts[at].cpu().numpy().astype(np.uint32),
                                 self.last_steps[at].cpu().numpy().astype(np.uint32), np.ones(len(keys), bool))

    @property
    def capacity(self) -> int:
        return self.index.capacity

    def insert_or_assign(self, keys, rows, optimizer_state=None) -> np.ndarray:
        """Write rows for keys, inserting the absent ones (no admission: an explicit write);
        returns which were present. Checked as the core store checks them."""
        return self._write(keys, rows, optimizer_state, insert=True)

    def assign(self, keys, rows, optimizer_state=None) -> np.ndarray:
        """Write rows for the keys that are present; returns which were."""
        return self._write(keys, rows, optimizer_state, insert=False)

    def _present(self, keys) -> np.ndarray:
        return self.index.contains(keys)

    def _write(self, keys, rows, optimizer_state, insert: bool) -> np.ndarray:
        if isinstance(keys, torch.Tensor):
            keys = keys.detach().cpu().numpy()
        found = self._present(keys)  # checks the keys as the core store does
        host = np.asarray(keys).astype(np.int64)
        rows = torch.as_tensor(rows).detach().cpu()
        if rows.dtype != torch.float32:  # as the core store: no silent casts
            raise TypeError(f"rows: expected float32, got {rows.dtype}")
        if tuple(rows.shape) != (len(host), self.dim):
            raise ValueError(f"rows: expected shape ({len(host)}, {self.dim}), got {tuple(rows.shape)}")
        if optimizer_state is not None:
            raise ValueError("optimizer_state: writes to device rows keep each row's optimizer state (load() "
                             "replaces it)")
        take = slice(None) if insert else found
        at = self.resolve(torch.from_numpy(host[take]), training=True, lookup=False)
        self.rows[at] = rows[take].to(self.device)
        return found

    def load(self, keys, rows, optimizer_state=None, counts=None, last_steps=None) -> None:
        """Replace or add rows with their state and metadata (as `EmbeddingStore.load`)."""
        host = np.asarray(keys, dtype=np.int64)
        counts = np.zeros(len(host), np.int64) if counts is None else counts
        last_steps = np.zeros(len(host), np.int64) if last_steps is None else last_steps
        if self.bounded:  # the index holds the metadata the policy reads, and the device slots
            slots, _ = self.index.find_or_insert(host)
            self.index.load(host, _encode_slots(slots), None, np.asarray(counts, np.int64),
                            np.asarray(last_steps, np.int64))
        else:
            slots, _ = self.index.find_or_insert(host)
        self._grow(int(slots.max()) + 2 if len(slots) else 1)
        at = torch.from_numpy(slots + 1).to(self.device)
        self.rows[at] = torch.as_tensor(rows).to(self.device)
        if optimizer_state is not None and self.state.shape[1]:
            self.state[at] = torch.as_tensor(optimizer_state).to(self.device)
        else:  # as the core's load: rows without state start from the optimizer's initial state
            self.state[at] = self.config.optimizer.initial_state if self.config.optimizer else 0.0
        self.counts[at] = torch.as_tensor(counts, dtype=torch.int64).to(self.device)
        self.last_steps[at] = torch.as_tensor(last_steps, dtype=torch.int64).to(self.device)
        self.slot_keys[torch.from_numpy(slots + 1)] = torch.from_numpy(host)

    def clear(self) -> None:
        self.index.clear()

    def reserve(self, n_rows: int) -> None:
        self.index.reserve(n_rows)
        self._grow(n_rows + 1)


class DeviceIndexedRows(DeviceRows):
    """Rows on an accelerator with their key index there too (`DeviceKeyIndex`): a lookup and
    its backward make no host round trip (Uniform or Constant initialisers; the normal laws
    draw new rows in the core on the host). The index holds each slot's access metadata, which
    the policies read; device row s + 1 holds slot s, row 0 is the zero row."""

    index: DeviceKeyIndex  # type: ignore[assignment]  # the base's methods use the same verbs of it

    def __init__(self, config: cncore.StoreConfig, device: torch.device, key_index: str | None = None):
        config = with_default_split(config, can_split=False)  # (DeviceKeyIndex refuses fallback rows)
        self.config = config
        self.device = torch.device(device)
        admission = config.admission
        if admission is not None and getattr(admission, "unadmitted", "zeros") != "zeros":
            raise ValueError(f"admission={admission!r}: rows on an accelerator read keys not admitted as zeros; "
                             "pass unadmitted='zeros', or keep this table on device='cpu' (the core)")
        self.bounded = config.eviction is not None or config.admission is not None or config.max_rows is not None
        self.index = DeviceKeyIndex(config, self.device)
        self._evict_callbacks = []
        self.evictions = 0
        self.index.on_evict(self._evicted_slots)
        self._step = 0
        cap = self.index.slot_capacity + 1
        self.rows = torch.zeros(cap, config.dim, device=self.device)
        self.state = torch.zeros(cap, config.state_floats, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: rows, optimizer state and the key index."""
        return sum(t.numel() * t.element_size() for t in (self.rows, self.state)) + self.index.nbytes

    @property
    def slot_keys(self) -> torch.Tensor:  # type: ignore[override]
        """Device row -> key (row 0, the zero row: key 0)."""
        return torch.cat([self.index.slot_keys.new_zeros(1), self.index.slot_keys[:-1]])

    @property
    def counts(self) -> torch.Tensor:  # type: ignore[override]
        return torch.cat([self.index.counts.new_zeros(1), self.index.counts[:-1]])

    @property
    def last_steps(self) -> torch.Tensor:  # type: ignore[override]
        return torch.cat([self.index.last_steps.new_zeros(1), self.index.last_steps[:-1]])

    def _evicted_slots(self, batch: EvictedSlots) -> None:
        """The index evicts these slots: copy their rows out before the slots are reused."""
        self.evictions += 1
        if not self._evict_callbacks:
            return
        at = batch.slots + 1
        out = cncore.TableBatch(batch.keys.cpu().numpy(), self.rows[at].cpu().numpy(), self.state[at].cpu().numpy(),
                                batch.counts.cpu().numpy().astype(np.uint32),
                                batch.last_steps.cpu().numpy().astype(np.uint32), np.ones(len(at), bool))
        for callback in list(self._evict_callbacks):
            callback(out)

    def _grow(self, rows_needed: int) -> None:
        cap = self.rows.shape[0]
        if rows_needed <= cap:
            return
        while cap < rows_needed:
            cap *= 2
        for name in ("rows", "state"):
            old = getattr(self, name)
            new = old.new_zeros((cap,) + tuple(old.shape[1:]))
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def _init_new(self, new_slots: torch.Tensor, new_keys: torch.Tensor) -> None:
        self._grow(self.index.high_water + 1)
        if len(new_slots):
            at = new_slots + 1
            self.rows[at] = initial_rows(self.config, new_keys)
            self.state[at] = self.config.optimizer.initial_state if self.config.optimizer else 0.0

    def resolve(self, keys: torch.Tensor, training: bool, lookup: bool = True) -> torch.Tensor:
        """Device row of every key, on the device (inserting and initialising unseen keys when
        training; a training lookup goes through admission, an explicit write does not)."""
        keys = torch.as_tensor(keys).to(self.device, torch.int64)
        if not training:
            return self.index.find(keys)[0] + 1
        r = self.index.find_or_insert(keys, admit=lookup)
        self._init_new(r.new_slots, r.new_keys)
        return r.slots + 1

    def gradients(self, rows_idx, offsets, weights, mode: int, grad_out):
        """(rows, their gradient, occurrences, d/d weights) in static shapes, with no host
        sync (`device_index.segments`): N entries for N IDs, the distinct rows first, then row
        0 with a zero gradient and no occurrence, which the update and the access records leave
        as they are (row 0 records into the index's spare slot)."""
        return pooled_row_gradients(self.rows, rows_idx, offsets, weights, mode, grad_out)

    def join_gradients(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One entry per distinct row of several lookups' `gradients`, in static shapes."""
        return join_row_gradients(parts)

    def gradient_keys(self, idx: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, gradients) of the rows the lookups read (the fill and row 0 left out: a host
        sync, which the hooks' host-side consumers pay anyway)."""
        keep = torch.nonzero(idx).squeeze(1)
        return self.index.slot_keys[idx[keep] - 1], grads[keep]

    def record_access(self, idx, occurrences, step: int) -> None:
        self.index.record_access(idx - 1, occurrences, min(int(step), 2**32 - 1))

    def export(self) -> cncore.TableBatch:
        """Every row, in slot order, as host NumPy arrays (as `EmbeddingStore.export` gives them)."""
        keys, slots = self.index.export_slots()
        at = slots + 1
        return cncore.TableBatch(keys.cpu().numpy(), self.rows[at].cpu().numpy(), self.state[at].cpu().numpy(),
                                 self.index.counts[slots].cpu().numpy().astype(np.uint32),
                                 self.index.last_steps[slots].cpu().numpy().astype(np.uint32),
                                 np.ones(len(slots), bool))

    def _present(self, keys) -> np.ndarray:
        return self.index.contains(torch.from_numpy(as_keys(keys))).cpu().numpy()  # checked as the core's

    def load(self, keys, rows, optimizer_state=None, counts=None, last_steps=None) -> None:
        """Replace or add rows with their state and metadata (as `EmbeddingStore.load`)."""
        host = np.asarray(keys, dtype=np.int64)
        n = len(host)
        r = self.index.find_or_insert(torch.from_numpy(host).to(self.device))
        self._grow(self.index.high_water + 1)
        at = r.slots + 1
        self.rows[at] = torch.as_tensor(rows).to(self.device)
        if optimizer_state is not None and self.state.shape[1]:
            self.state[at] = torch.as_tensor(optimizer_state).to(self.device)
        else:  # as the core's load: rows without state start from the optimizer's initial state
            self.state[at] = self.config.optimizer.initial_state if self.config.optimizer else 0.0
        counts = np.zeros(n, np.int64) if counts is None else np.asarray(counts, np.int64)
        last_steps = np.zeros(n, np.int64) if last_steps is None else np.asarray(last_steps, np.int64)
        self.index.set_metadata(r.slots, torch.from_numpy(counts), torch.from_numpy(last_steps))

    def reserve(self, n_rows: int) -> None:
        self.index.reserve(n_rows)
        self._grow(n_rows + 1)
