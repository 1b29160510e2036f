"""Rows in accelerator memory (the "cncard" placement): the core keeps the key index on the
host; rows, optimizer state and access metadata are tensors on the device; lookups and
updates are PyTorch ops over the slots the core returns.

Device row 0 is a permanent zero row: slot s lives at row s + 1, and a key unseen in
evaluation reads row 0. Growth reallocates the tensors (doubling) and copies the rows over.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import cncore

_MODES = ("sum", "mean", "max")


class DeviceRows:
    def __init__(self, config: cncore.StoreConfig, device: torch.device):
        self.config = config
        self.device = device
        # The index: a store whose one-float rows are never read (the rows live on the device).
        self.index = cncore.EmbeddingStore(cncore.StoreConfig(dim=1, capacity=config.capacity,
                                                              max_load_factor=config.max_load_factor,
                                                              initializer=cncore.Constant(0.0)))
        self.step = 0
        cap = max(16, config.capacity + 1)
        self.rows = torch.zeros(cap, config.dim, device=device)
        self.state = torch.zeros(cap, config.state_floats, device=device)
        self.counts = torch.zeros(cap, dtype=torch.int64, device=device)
        self.last_steps = torch.zeros(cap, dtype=torch.int64, device=device)
        self.slot_keys = torch.zeros(cap, dtype=torch.int64)  # host: row -> key, for gradients and export

    def __len__(self):
        return len(self.index)

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

    def resolve(self, keys: torch.Tensor, training: bool) -> torch.Tensor:
        """Device row of every key (inserting and initialising unseen keys when training)."""
        host = keys.detach().cpu().numpy()
        if training:
            slots, found = self.index.find_or_insert(host)
            if not found.all():
                new_slots, first = np.unique(slots[~found], return_index=True)
                new_keys = host[~found][first]
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
        inv = (1.0 / lengths.clamp(min=1).to(weights.dtype)).repeat_interleave(lengths)
        return 0, weights * inv, inv

    def pool(self, rows_idx, offsets, weights, mode: int):
        mode, weights, _ = self._weighted_mean_as_sum(offsets, weights, mode)
        return F.embedding_bag(rows_idx, self.rows, offsets, mode=_MODES[mode], per_sample_weights=weights,
                               include_last_offset=True)

    def gradients(self, rows_idx, offsets, weights, mode: int, grad_out):
        """(unique device rows, their gradient, occurrences, d/d weights): autograd through the
        pooling over just the rows this batch used (a (U, dim) copy), the zero row left out."""
        mode, weights, inv_len = self._weighted_mean_as_sum(offsets, weights, mode)
        unique, position, occurrences = torch.unique(rows_idx, return_inverse=True, return_counts=True)
        sub = self.rows[unique].detach().requires_grad_()
        pw = None if weights is None else weights.detach().requires_grad_()
        with torch.enable_grad():
            out = F.embedding_bag(position, sub, offsets, mode=_MODES[mode], per_sample_weights=pw,
                                  include_last_offset=True)
            grads = torch.autograd.grad(out, [sub] if pw is None else [sub, pw], grad_out)
        grad_weights = None
        if pw is not None:
            grad_weights = grads[1] if inv_len is None else grads[1] * inv_len
        keep = unique != 0
        return unique[keep], grads[0][keep], occurrences[keep], grad_weights

    def record_access(self, idx, occurrences, step: int) -> None:
        self.counts[idx] += occurrences
        self.last_steps[idx] = step

    def apply(self, idx, g, lr: float) -> None:
        """The fused optimizer on rows idx with gradients g (same formulas as the core)."""
        opt = self.config.optimizer
        self.step += 1
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

    def export(self) -> dict:
        keys = self.index.export().keys
        slots, _ = self.index.find(keys)
        at = torch.from_numpy(slots + 1).to(self.device)
        return {"keys": torch.from_numpy(keys), "rows": self.rows[at].cpu(), "optimizer_state": self.state[at].cpu(),
                "counts": self.counts[at].cpu(), "last_steps": self.last_steps[at].cpu()}

    def load(self, keys, rows, optimizer_state, counts, last_steps) -> None:
        host = np.asarray(keys, dtype=np.int64)
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
