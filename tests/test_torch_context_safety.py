"""A lookup's backward meets the table it was made on, or is refused (issue 9, item 16): moving
a module between devices between forward and backward built a new store whose erase epoch
equalled the old one, and the backward updated the new store's rows at the old slots."""
import numpy as np
import pytest
import torch

import cncore
from cncore_torch import CNEmbeddingBag


def rows_by_key(bag):
    e = bag.export()
    order = torch.argsort(e["keys"])
    return e["keys"][order].tolist(), e["rows"][order].clone()


@pytest.mark.parametrize("route", [("cncard", "cpu"), ("cncard",)])
def test_moving_between_forward_and_backward_refuses_the_update(monkeypatch, route):
    monkeypatch.setenv("CNCORE_CNCARD", "cpu")
    bag = CNEmbeddingBag(100, 4, mode="sum", optimizer=cncore.SGD(lr=1.0))
    bag(torch.tensor([[5, 6, 7]]))                # rows exist before the step we interrupt
    bag.train()
    out = bag(torch.tensor([[7, 8], [5, 5]]))
    for device in route:
        bag.move_to(device)
    keys_before, rows_before = rows_by_key(bag)
    with pytest.raises(RuntimeError, match="erased|moved off the core"):
        out.sum().backward()
    keys_after, rows_after = rows_by_key(bag)
    assert keys_after == keys_before == [5, 6, 7, 8]
    assert torch.equal(rows_after, rows_before)


def test_erase_between_forward_and_backward_refuses_the_update_through_torch():
    bag = CNEmbeddingBag(100, 4, mode="mean", optimizer=cncore.Adagrad(lr=0.5))
    out = bag(torch.tensor([[1, 2], [3, 4]]))
    bag.store.erase(np.array([2]))
    keys_before, rows_before = rows_by_key(bag)
    with pytest.raises(RuntimeError, match="erased"):
        out.sum().backward()
    keys_after, rows_after = rows_by_key(bag)
    assert keys_after == keys_before == [1, 3, 4] and torch.equal(rows_after, rows_before)
    assert bag.store.step == 0


STRESS = """
import json, threading, time
import numpy as np, torch, cncore
from cncore_torch import CNEmbeddingBag
torch.set_num_threads(1)
def make():
    return CNEmbeddingBag(16, 8, mode="sum", optimizer=cncore.SGD(lr=0.5), initializer=cncore.Uniform(-1, 1), seed=3)
bag = make()
stop = time.monotonic() + SECONDS
logs = {"train": [], "insert": [], "erase": [], "exports": 0, "restarts": 0}
def train():       # keys [0, 5000) through the torch ops: forward, backward (fused SGD in the core)
    rng = np.random.default_rng(11)
    while time.monotonic() < stop:
        ids = rng.integers(0, 5000, (8, 8))
        weight = rng.standard_normal((8, 8)).astype(np.float32)
        out = bag(torch.from_numpy(ids))
        try:
            (out * torch.from_numpy(weight)).sum().backward()
            applied = True
        except RuntimeError:
            applied = False
        logs["train"].append((ids.tolist(), weight.tolist(), applied))
def insert():      # keys [10**9, ...) written through the store
    rng = np.random.default_rng(12)
    while time.monotonic() < stop:
        keys = 10**9 + rng.integers(0, 20000, 128)
        rows = rng.standard_normal((128, 8)).astype(np.float32)
        bag.store.insert_or_assign(keys, rows)
        logs["insert"].append((keys.tolist(), rows.tolist()))
def erase():       # keys [-10**6, ...): inserted, then some erased (the erase epoch moves)
    rng = np.random.default_rng(13)
    while time.monotonic() < stop:
        keys = -10**6 + rng.integers(0, 3000, 64)
        bag.store.find_or_insert(keys)
        gone = rng.integers(0, 3000, 48) - 10**6
        bag.store.erase(gone)
        logs["erase"].append((keys.tolist(), gone.tolist()))
def export():      # state_dict exports while the others write
    while time.monotonic() < stop:
        sd = bag.state_dict()
        assert len(sd["keys"]) == len(sd["rows"])
        logs["exports"] += 1
def grow():
    n = 1024
    while time.monotonic() < stop and n < 200000:
        bag.store.reserve(n); n = int(n * 1.5); time.sleep(0.01)
threads = [threading.Thread(target=f) for f in (train, insert, erase, export, grow)]
[t.start() for t in threads]; [t.join() for t in threads]
replay = make()
applied = 0
for ids, weight, ok in logs["train"]:
    out = replay(torch.tensor(ids))
    if ok:
        (out * torch.tensor(weight)).sum().backward()
        applied += 1
for keys, rows in logs["insert"]:
    replay.store.insert_or_assign(np.array(keys), np.array(rows, dtype=np.float32))
for keys, gone in logs["erase"]:
    replay.store.find_or_insert(np.array(keys))
    replay.store.erase(np.array(gone))
got, want = bag.store.export(), replay.store.export()
go, wo = np.argsort(got.keys), np.argsort(want.keys)
print(json.dumps(dict(n_train=len(logs["train"]), applied=applied, refused=len(logs["train"]) - applied,
                      exports=logs["exports"], keys_equal=bool(np.array_equal(got.keys[go], want.keys[wo])),
                      rows_equal=bool(np.array_equal(got.rows[go], want.rows[wo])),
                      step_equal=bag.store.step == replay.store.step == applied)))
"""


def test_threaded_stress_through_the_torch_ops_equals_a_serial_replay():
    """Training through the module's torch ops, inserts, erases, state_dict exports and growth
    on one store from five threads, each thread on its own key range: the final table equals
    each thread's serial replay (training replayed through a fresh module, applying exactly the
    updates the run applied; a refused one still inserted its keys in the forward)."""
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", STRESS.replace("SECONDS", "2.5")], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["n_train"] > 0 and result["exports"] > 0
    assert result["keys_equal"] and result["rows_equal"] and result["step_equal"], result
