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


def print_churn(percent: float, rows: list[dict]) -> None:
    def auto(m):
        return "-" if m is None else f"{m['churn']:.3f} / {m['repeat']:.2f} / {m['fallback_rows']:,}"

    def f(x, spec):
        return "-" if x is None else format(x, spec)
    for r in rows:
        print(f"| {percent:g}% | {r['table']} | {r['max_rows']:,} | {r['distinct_per_call']:.1f} | "
              f"{f(r['fill_calls'], 'd')} | {f(r['fill_churn'], '.3f')} | {f(r['fill_repeat'], '.2f')} | "
              f"{f(r['miss_after'], '.3f')} | "
              f"{f(r['new_after'], '.3f')} | {auto(r['auto'])} |", flush=True)


CHURN_HEADER = ("| budget | table | max_rows | distinct IDs a call | fill calls | fill churn (new a call / max_rows) | "
                "fill repeat (occurrences / distinct, a call) | miss after (of a call's distinct) | "
                "new after (a call / max_rows) | auto: churn / repeat / fallback rows |\n"
                + "|---" * 10 + "|")
