"""Each bounded table's churn through a training run (`bounded_auc.py --churn`): how fast its
new IDs fill the budget, and how many of a batch's IDs miss once it is full.

Per table and training call, before the call: the distinct IDs the batch looks the table up
with, and how many of them have no row (`contains`, which records no access); after it: the rows
inserted (rows held + rows evicted, before against after). Per table the run reports

- ``fill calls``: the calls up to and including the first one whose new IDs do not fit (rows
  held + new IDs > max_rows: the call that would have to evict, at which a
  ``fallback_rows="auto"`` table decides its split; "-" if the table never fills);
- ``fill churn``: the new IDs per call up to and including that call, over max_rows (what such
  a table measures: rows held before it plus its new IDs, over the calls, over max_rows);
- ``fill repeat``: the occurrences of the table's IDs in those calls over their distinct IDs
  (summed call by call): how often a call looks up each of its IDs;
- ``miss after``: the mean over the calls after the fill of the fraction of a call's distinct
  IDs that had no row;
- ``new after``: the mean new IDs per call after the fill, over max_rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np


def table_features(run) -> dict[str, list[str]]:
    """{table name: its features} of a run of ours."""
    return {c.name: list(c.feature_names) for c in run.tables.embedding_bag_configs()}


def churn_of_run(run, batches) -> list[dict]:
    """Step `run` (one of ours, bounded) through `batches`, measuring each table's churn."""
    stores = run.tables.stores
    features = table_features(run)
    # per call: distinct IDs, new IDs, rows held, rows inserted, occurrences
    calls: dict[str, list[tuple[int, int, int, int, int]]] = {name: [] for name in stores}
    for batch in batches:
        per_feature = batch.sparse.to_dict()
        before = {}
        for name, store in stores.items():
            every = np.concatenate([per_feature[f].values().numpy() for f in features[name]])
            keys = np.unique(every)
            missing = int((~store.contains(keys)).sum())
            before[name] = (len(keys), missing, len(store), len(store) + int(store.evicted_count), len(every))
        run.step(batch)
        for name, store in stores.items():
            distinct, missing, held, seen_before, occurrences = before[name]
            calls[name].append((distinct, missing, held, len(store) + int(store.evicted_count) - seen_before,
                                occurrences))
    out = []
    for name, store in stores.items():
        max_rows = store.config.max_rows
        per_call = calls[name]
        fill = next((i for i, c in enumerate(per_call) if c[2] + c[1] > max_rows), None)
        row: dict = {"table": name, "max_rows": max_rows, "calls": len(per_call),
                     "distinct_per_call": float(np.mean([c[0] for c in per_call]))}
        if fill is None:
            row.update(fill_calls=None, fill_churn=None, fill_repeat=None, miss_after=None, new_after=None)
        else:
            filling, after = per_call[:fill + 1], per_call[fill + 1:]
            new_to_fill = sum(c[1] for c in filling)
            row.update(fill_calls=fill + 1, fill_churn=new_to_fill / (fill + 1) / max_rows,
                       fill_repeat=sum(c[4] for c in filling) / max(1, sum(c[0] for c in filling)),
                       miss_after=float(np.mean([c[1] / max(c[0], 1) for c in after])) if after else None,
                       new_after=float(np.mean([c[1] for c in after])) / max_rows if after else None)
        measures = getattr(store, "split_measures", None)
        row["auto"] = None if measures is None else dataclasses.asdict(measures)
        out.append(row)
    return out


def _cell(x, spec: str) -> str:
    """A table cell: `x` formatted by `spec`, or "-" where there is no value."""
    return "-" if x is None else format(x, spec)


def print_churn(percent: float, rows: list[dict]) -> None:
    def auto(m):
        return "-" if m is None else f"{m['churn']:.3f} / {m['repeat']:.2f} / {m['fallback_rows']:,}"

    f = _cell
    for r in rows:
        print(f"| {percent:g}% | {r['table']} | {r['max_rows']:,} | {r['distinct_per_call']:.1f} | "
              f"{f(r['fill_calls'], 'd')} | {f(r['fill_churn'], '.3f')} | {f(r['fill_repeat'], '.2f')} | "
              f"{f(r['miss_after'], '.3f')} | "
              f"{f(r['new_after'], '.3f')} | {auto(r['auto'])} |", flush=True)


CHURN_HEADER = ("| budget | table | max_rows | distinct IDs a call | fill calls | fill churn (new a call / max_rows) | "
                "fill repeat (occurrences / distinct, a call) | miss after (of a call's distinct) | "
                "new after (a call / max_rows) | auto: churn / repeat / fallback rows |\n"
                + "|---" * 10 + "|")


def head_coverage(seen: np.ndarray, call: np.ndarray, max_rows: int) -> tuple[float, float]:
    """The share of the lookups `seen` (every key looked up so far, repeats included) and of the
    call's lookups `call` that the `max_rows` most-counted keys of `seen` cover (ties broken by
    the smaller key).

    >>> head_coverage(np.array([1, 1, 1, 2, 3, 3]), np.array([1, 2, 3]), 2)
    (0.8333333333333334, 0.6666666666666666)
    """
    keys, counts = np.unique(seen, return_counts=True)
    head = keys[np.lexsort((keys, -counts))[:max_rows]]
    return (float(counts[np.isin(keys, head)].sum() / max(1, len(seen))),
            float(np.isin(call, head).sum() / max(1, len(call))))


def measures_of_run(run, batches, after: int = 8) -> list[dict]:
    """Step `run` (ours, a row per ID: `ours-lfu`, which fills as an auto table does) through
    `batches`, measuring for each table at its fill (the first call whose new IDs do not fit)
    the split's candidate measures:

    - ``head_all``, ``head_call``: `head_coverage` of every lookup up to and including the fill
      call, and of the fill call's lookups, by the max_rows most-counted keys so far;
    - ``victims_return``: over the `after` calls after the fill, the share of the missed keys
      (distinct keys of a call without a row) that the table had evicted before that call (a
      returning victim is where a shared trained row would beat a fresh one); None if none missed;
    - ``seen_return``: over those calls, the share of the missed keys that an earlier call had
      looked up (evicted, or never given a row: a call whose distinct keys exceed max_rows
      leaves the overflow without one, so they never reach the sink);
    - ``head_after``: over those calls, the share of their lookups that the max_rows
      most-counted keys before each call cover (what an oracle of counts could keep keyed);
    - ``fill_calls``, ``churn``, ``repeat`` as `churn_of_run` (fill churn and repeat a call).
    """
    stores = run.tables.stores
    features = table_features(run)
    evicted: dict[str, list[np.ndarray]] = {name: [] for name in stores}
    for name, store in stores.items():
        store.on_evict(lambda batch, name=name: evicted[name].append(np.array(batch.keys)))
    seen: dict[str, list[np.ndarray]] = {name: [] for name in stores}
    state: dict[str, dict] = {name: {"calls": 0, "new": 0, "occurrences": 0, "distinct": 0, "fill": None,
                                     "missed": 0, "returned": 0, "after": 0,
                                     "head_covered": 0.0, "head_lookups": 0, "seen_returned": 0} for name in stores}
    out: dict[str, dict] = {}
    for batch in batches:
        per_feature = batch.sparse.to_dict()
        for name, store in stores.items():
            s = state[name]
            every = np.concatenate([per_feature[f].values().numpy() for f in features[name]])
            keys = np.unique(every)
            missing = keys[~store.contains(keys)]
            max_rows = store.config.max_rows
            if s["fill"] is None:
                s["calls"] += 1
                s["new"] += len(missing)
                s["occurrences"] += len(every)
                s["distinct"] += len(keys)
                seen[name].append(every)
                if len(store) + len(missing) > max_rows:
                    s["fill"] = s["calls"]
                    head_all, head_call = head_coverage(np.concatenate(seen[name]), every, max_rows)
                    seen[name] = [np.concatenate(seen[name])]
                    out[name] = {"table": name, "max_rows": max_rows, "fill_calls": s["calls"],
                                 "churn": s["new"] / s["calls"] / max_rows,
                                 "repeat": s["occurrences"] / max(1, s["distinct"]),
                                 "head_all": head_all, "head_call": head_call}
            elif s["after"] < after:
                s["after"] += 1
                gone = np.concatenate(evicted[name]) if evicted[name] else np.empty(0, np.int64)
                s["missed"] += len(missing)
                s["returned"] += int(np.isin(missing, gone).sum())
                s["seen_returned"] += int(np.isin(missing, np.concatenate(seen[name])).sum())
                s["head_covered"] += head_coverage(np.concatenate(seen[name]), every, max_rows)[1] * len(every)
                s["head_lookups"] += len(every)
                seen[name].append(every)
        run.step(batch)
    rows = []
    for name, store in stores.items():
        s = state[name]
        row = out.get(name, {"table": name, "max_rows": store.config.max_rows, "fill_calls": None, "churn": None,
                             "repeat": None, "head_all": None, "head_call": None})
        row["victims_return"] = s["returned"] / s["missed"] if s["missed"] else None
        row["seen_return"] = s["seen_returned"] / s["missed"] if s["missed"] else None
        row["head_after"] = s["head_covered"] / s["head_lookups"] if s["head_lookups"] else None
        rows.append(row)
    return rows


def print_measures(percent: float, rows: list[dict]) -> None:
    f = _cell
    for r in rows:
        print(f"| {percent:g}% | {r['table']} | {r['max_rows']:,} | {f(r['fill_calls'], 'd')} | "
              f"{f(r['churn'], '.3f')} | {f(r['repeat'], '.2f')} | {f(r['head_all'], '.3f')} | "
              f"{f(r['head_call'], '.3f')} | {f(r['head_after'], '.3f')} | {f(r['victims_return'], '.3f')} | "
              f"{f(r['seen_return'], '.3f')} |",
              flush=True)


MEASURES_HEADER = ("| budget | table | max_rows | fill calls | churn | repeat a call | head coverage, all lookups | "
                   "head coverage, the fill call | head coverage, next calls | victims' return (next calls' misses "
                   "evicted before) | seen return (next calls' misses looked up before) |\n" + "|---" * 11 + "|")
