"""Training through the torch modules while another thread erases keys of the same table.

One thread trains a CNEmbeddingBag with a fused optimizer on IDs 0..999 (forward, backward;
sum, weighted mean, max; also with no optimizer, the gradients going to a hook that checks
them; and a CNEmbeddingBagCollection, grouped lookup and backward); another erases random IDs
of that range through `store.erase`. A backward whose lookup lost keys to an erase must
either apply or raise the documented RuntimeError ("keys were erased ... since this lookup"),
never crash or raise anything else. Afterwards the table must be consistent: unique keys,
len equal to their number, every key found, every row and optimizer state finite.

The race runs in a child process (2 s per mode), so that a crash fails the test instead of
killing the run; the child prints one JSON line per mode.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SECONDS = 2.0
MODES = ("sum", "mean", "max", "sum+hooks", "collection")
# +hooks: no fused optimizer, gradients to a hook; collection: CNEmbeddingBagCollection, two features of one
# table and a table of its own, one grouped lookup and one grouped backward a step

CHILD = textwrap.dedent("""
    import faulthandler, json, sys, threading, time
    import numpy as np, torch, cncore
    from cncore_torch import CNEmbeddingBag

    faulthandler.enable()
    torch.set_num_threads(1)
    ERASED = "keys were erased"

    def collection():
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        from cncore_torch import CNEmbeddingBagCollection
        ebc = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1000,
                                                           feature_names=["f", "g"]),
                                        EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=1000,
                                                           feature_names=["h"])], optimizer=cncore.Adagrad(lr=0.05))

        def forward(ids, weights):  # the (64, 8) IDs as 3 keys x batch 21, bags of 8 (weights unused)
            kjt = KeyedJaggedTensor(keys=["f", "g", "h"], values=ids[:63].reshape(-1), lengths=torch.full((63,), 8))
            return ebc(kjt).values()
        return ebc, ebc.stores["t"], forward

    def race(name, seconds):
        if name == "collection":
            ebc, store, forward = collection()
            return run(name, store, forward, "sum", seconds)
        mode, hooks = name.split("+")[0], name.endswith("+hooks")
        bag = CNEmbeddingBag(1000, 8, mode=mode, optimizer=None if hooks else cncore.Adagrad(lr=0.05),
                             initializer=cncore.Normal(0, 0.1))
        if hooks:
            def hook(ids, grads):
                assert ids.shape[0] == grads.shape[0] == len(set(ids.tolist())), "one gradient row per distinct ID"
                assert bool(((ids >= 0) & (ids < 1000)).all()) and bool(torch.isfinite(grads).all())
            bag.register_gradient_hook(hook)
        return run(name, bag.store, lambda ids, weights: bag(ids, per_sample_weights=weights), mode, seconds)

    def run(name, store, forward, mode, seconds):
        stop = time.monotonic() + seconds
        counts = {"applied": 0, "refused": 0, "erased": 0, "erase_calls": 0}
        failures = []

        def train():
            rng = np.random.default_rng(0)
            try:
                while time.monotonic() < stop:
                    ids = torch.from_numpy(rng.integers(0, 1000, (64, 8)))
                    weights = torch.rand(64, 8) if mode != "max" else None
                    out = forward(ids, weights)
                    try:
                        out.square().sum().backward()
                        counts["applied"] += 1
                    except RuntimeError as exc:
                        if ERASED not in str(exc) or "since this lookup" not in str(exc):
                            raise
                        counts["refused"] += 1
            except BaseException as exc:
                failures.append(f"training thread: {type(exc).__name__}: {exc}")

        def erase():
            rng = np.random.default_rng(1)
            try:
                while time.monotonic() < stop:
                    counts["erased"] += int(store.erase(rng.integers(0, 1000, 16)).sum())
                    counts["erase_calls"] += 1
                    time.sleep(0.0005)  # let the trainer run between erasures
            except BaseException as exc:
                failures.append(f"erasing thread: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=train), threading.Thread(target=erase)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        batch = store.export()
        keys = np.asarray(batch.keys)
        return {"mode": name, **counts, "failures": failures, "len": len(store), "exported": len(keys),
                "distinct": len(np.unique(keys)), "all_found": bool(store.contains(keys).all()),
                "in_range": bool(((keys >= 0) & (keys < 1000)).all()),
                "rows_finite": bool(np.isfinite(batch.rows).all()),
                "state_finite": bool(np.isfinite(batch.optimizer_state).all())}

    for mode in sys.argv[2:]:
        print("RESULT " + json.dumps(race(mode, float(sys.argv[1]))), flush=True)
""")


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run([sys.executable, "-c", CHILD, str(SECONDS), *MODES], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    got = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            record = json.loads(line[len("RESULT "):])
            got[record["mode"]] = record
    return got, proc


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_training_beside_erasure_applies_or_refuses_and_leaves_a_consistent_table(results, mode):
    got, proc = results
    assert mode in got, (f"the child died (status {proc.returncode}) before finishing mode {mode!r}:\n"
                         f"{proc.stderr[-3000:]}")
    r = got[mode]
    assert not r["failures"], r["failures"]
    assert r["applied"] > 0 and r["erase_calls"] > 0 and r["erased"] > 0, r  # both threads ran
    assert r["len"] == r["exported"] == r["distinct"], r  # len counts every key, each key once
    assert r["all_found"] and r["in_range"], r
    assert r["rows_finite"] and r["state_finite"], r
