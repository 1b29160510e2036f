"""Checkpoints whose parts were moved, swapped, dropped or mixed across saves: every load and
merge gives exactly a table that one save held, or refuses in one line and changes nothing.

- Table file chains: each delta records its own name and its parent's manifest digest, so a
  link replaced by another run's link, or versions renamed, is refused; chains written before
  (no digests) read as before. A generated harness mutates chains and compares each outcome
  with the in-memory states the runs held.
- Shard files and state_dicts of sharded collections record rank, world size and save: two
  real gloo ranks save twice (and a second run once); every mix of their shard files (drop,
  swap, take from another save) is loaded on both ranks, and every mix of state_dicts merged.
- Table names are directory names: one plain path component, checked before anything is written.
- cn-dlrm's incremental checkpoints: a save killed after any of its file operations leaves a
  directory that resumes at the previous save (or the new one once complete).
"""
import json
import os
import shutil

import numpy as np
import pytest

import cncore
from cncore.routing import owner_of, shard_name
from cncore.tablefile import TableFormatError, compact_table, load_store, save_table
from reference import run_isolated, snapshot, tree

FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")


# --- chains: links replaced, renamed, removed --------------------------------------------------------

def _train(store, keys, seed):
    g = np.random.default_rng(seed).standard_normal((len(keys), store.config.dim)).astype(np.float32)
    _, ctx = store.pooled_lookup(np.asarray(keys, np.int64), lengths=np.ones(len(keys), np.int64))
    store.apply_gradients(ctx, g)


def _run(path, seed, saves=3):
    """A store trained and saved `saves` times to `path` (a base, then deltas); returns the
    snapshot of the store at each save, by version."""
    store = cncore.EmbeddingStore(dim=2, optimizer=cncore.Adagrad(lr=0.1), seed=5)
    rng = np.random.default_rng(seed)
    held, since = {}, None
    for i in range(saves):
        _train(store, rng.integers(0, 40, 12), seed * 100 + i)
        if i and rng.random() < 0.5:
            store.erase(rng.integers(0, 40, 3))
        since = save_table(store, path, since=since)
        held[since.version] = snapshot(store)
    assert since.chain == saves - 1
    return held


def _same(a, b) -> bool:
    return a[0] == b[0] and a[6] == b[6] and all(np.array_equal(x, y) for x, y in zip(a[1:6], b[1:6]))


def _refused_unchanged(path, match):
    before = tree(path)
    for call in (lambda: load_store(path), lambda: compact_table(path), lambda: compact_table(path, out=path + "-out")):
        with pytest.raises(TableFormatError, match=match):
            call()
        assert tree(path) == before and not os.path.exists(path + "-out")


def test_a_chain_with_a_middle_link_from_another_run_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _run(a, 1), _run(b, 2)
    shutil.rmtree(os.path.join(a, "v000002"))
    shutil.copytree(os.path.join(b, "v000002"), os.path.join(a, "v000002"))
    _refused_unchanged(a, r"v000003 is a delta over a v000002 whose manifest.json has SHA-256 [0-9a-f]{16}\.\.\., but "
                          r"v000002/manifest.json here has [0-9a-f]{16}\.\.\.: v000002 was replaced by another save's")


def test_a_chain_whose_versions_were_renamed_is_refused(tmp_path):
    a = str(tmp_path / "a")
    _run(a, 1)
    os.rename(os.path.join(a, "v000002"), os.path.join(a, "tmp"))
    os.rename(os.path.join(a, "v000003"), os.path.join(a, "v000002"))
    os.rename(os.path.join(a, "tmp"), os.path.join(a, "v000003"))
    _refused_unchanged(a, r"v000003/manifest.json was written as v000002: the chain's versions were renamed")


def _strip_links(path):
    """Rewrite every delta's manifest as deltas were written before they recorded links."""
    import hashlib
    for version in sorted(os.listdir(path)):
        manifest = os.path.join(path, version, "manifest.json")
        if not os.path.isfile(manifest):
            continue
        m = json.load(open(manifest))
        if "delta" not in m:
            continue
        assert set(m["delta"]) == {"parent", "removed", "name", "parent_sha256"}
        del m["delta"]["name"], m["delta"]["parent_sha256"]
        text = json.dumps(m, indent=1).encode()
        for name, data in (("manifest.json", text),
                           ("manifest.sha256", f"{hashlib.sha256(text).hexdigest()}  manifest.json\n".encode())):
            os.chmod(os.path.join(path, version, name), 0o644)
            open(os.path.join(path, version, name), "wb").write(data)


def test_a_chain_written_before_links_were_recorded_loads_and_compacts_as_before(tmp_path):
    a = str(tmp_path / "a")
    held = _run(a, 3, saves=4)
    _strip_links(a)
    assert _same(snapshot(load_store(a)), held["v000004"])
    compact_table(a)
    assert os.listdir(a) and sorted(e for e in os.listdir(a) if e.startswith("v")) == ["v000005"]
    assert _same(snapshot(load_store(a)), held["v000004"])


def _mutate(path, other, kind, i, j):
    """Apply one mutation to chain directory `path` (versions v000001..), `other`: another
    run's chain of the same length."""
    versions = sorted(e for e in os.listdir(path) if e.startswith("v"))
    vi, vj = versions[i % len(versions)], versions[j % len(versions)]
    if kind == "remove":
        shutil.rmtree(os.path.join(path, vi))
    elif kind == "swap" and vi != vj:
        os.rename(os.path.join(path, vi), os.path.join(path, "swap"))
        os.rename(os.path.join(path, vj), os.path.join(path, vi))
        os.rename(os.path.join(path, "swap"), os.path.join(path, vj))
    elif kind == "substitute":
        shutil.rmtree(os.path.join(path, vi))
        shutil.copytree(os.path.join(other, vi), os.path.join(path, vi))
    elif kind == "current":  # CURRENT set back to an earlier version (a state the run held)
        with open(os.path.join(path, "CURRENT"), "w") as fh:
            fh.write(vi + "\n")
    elif kind == "rename":  # one link moved to a new, later name, CURRENT following it
        new = f"v{len(versions) + 1:06d}"
        os.rename(os.path.join(path, vi), os.path.join(path, new))
        with open(os.path.join(path, "CURRENT"), "w") as fh:
            fh.write(new + "\n")


COUNTS = {"cases": 0, "exact": 0, "refused": 0, "silent": 0, "crashes": 0}


@pytest.fixture(scope="module")
def chain_counts():
    yield COUNTS
    print(f"\nchain harness: {COUNTS}")


def test_mutated_chains_load_exactly_a_held_table_or_are_refused_unchanged(tmp_path_factory, chain_counts):
    """Generated: two runs' chains (random training, erases, 2-6 saves), one or two mutations
    of the first (a link removed, two swapped, one substituted from the other run, CURRENT
    set back, a link renamed). load_store either gives exactly a state one of the runs held
    when it saved, or raises TableFormatError with the directory unchanged (and compact too)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    mutation = st.tuples(st.sampled_from(["remove", "swap", "substitute", "current", "rename", "none"]),
                         st.integers(0, 5), st.integers(0, 5))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(seeds=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), saves=st.integers(2, 6),
           mutations=st.lists(mutation, min_size=1, max_size=2))
    def case(seeds, saves, mutations):
        root = str(tmp_path_factory.mktemp("chain"))
        a, b = os.path.join(root, "a"), os.path.join(root, "b")
        held = list(_run(a, seeds[0], saves).values()) + list(_run(b, seeds[1], saves).values())
        for kind, i, j in mutations:
            _mutate(a, b, kind, i, j)
        COUNTS["cases"] += 1
        before = tree(a)
        try:
            got = snapshot(load_store(a))
        except TableFormatError:
            COUNTS["refused"] += 1
            assert tree(a) == before
            with pytest.raises(TableFormatError):
                compact_table(a)
            assert tree(a) == before
            return
        except BaseException:
            COUNTS["crashes"] += 1
            raise
        if not any(_same(got, h) for h in held):
            COUNTS["silent"] += 1
            raise AssertionError(f"{mutations}: loaded a table neither run held")
        COUNTS["exact"] += 1

    case()
    assert COUNTS["cases"] >= 60 and COUNTS["silent"] == COUNTS["crashes"] == 0
    assert COUNTS["refused"] > 10 and COUNTS["exact"] > 10  # both outcomes were exercised


# --- cn-dlrm's incremental checkpoints: killed at every file operation of a save ---------------------

_KILL_DRIVER = r'''
import builtins, json, os, shutil, signal, sys, time
import numpy as np
import torch
import cncore
from cncore_torch.dlrm.chains import TableChains

ROOT, SCENARIO = sys.argv[1], sys.argv[2]
PREFIX = "sparse."
REAL_OPEN = builtins.open


def train(stores, step):
    for i, (name, store) in enumerate(sorted(stores.items())):
        rng = np.random.default_rng(step * 10 + i)
        keys = rng.integers(0, 60, 16)
        _, ctx = store.pooled_lookup(keys, lengths=np.ones(16, np.int64))
        store.apply_gradients(ctx, rng.standard_normal((16, 2)).astype(np.float32))
        if step % 2:
            store.erase(rng.integers(0, 60, 4))


def state(model, stores, step):
    from cncore_torch.state import save_store
    out = {"dense": {k: v.clone() for k, v in model.state_dict().items()}, "step": step}
    for name, store in stores.items():
        save_store(store, out, f"{PREFIX}{name}.")
    return out


class Killed(Exception):
    pass


def hook(limit):
    """Kill this process (SIGKILL) just before its limit-th file operation."""
    count = [0]

    def wrap(fn, writes_only=False):
        def inner(*args, **kwargs):
            if writes_only:
                mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
                if not any(c in str(mode) for c in "wax+"):
                    return fn(*args, **kwargs)
            count[0] += 1
            if count[0] >= limit:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return inner
    for mod, name in ((os, "rename"), (os, "replace"), (os, "remove"), (os, "unlink"), (os, "rmdir"),
                      (os, "fsync"), (os, "makedirs"), (os, "mkdir"), (shutil, "rmtree")):
        setattr(mod, name, wrap(getattr(mod, name)))
    builtins.open = wrap(builtins.open, writes_only=True)
    return count


def child(directory, limit):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stores = {n: cncore.EmbeddingStore(dim=2, optimizer=cncore.Adagrad(lr=0.1), seed=i + 1,
                                       max_rows=40, eviction=cncore.LRU())
              for i, n in enumerate(("t_a", "t_b"))}
    chains = TableChains(directory, 1)
    for step in range(1, 4):  # a base and two deltas
        train(stores, step)
        with torch.no_grad():
            model.weight += 0.5
        chains.save(model, [opt], stores, step)
    if SCENARIO == "base":  # a resumed run: its first save is a base after the chain
        chains = TableChains(directory, 1)
    torch.save(state(model, stores, 3), directory + ".prev")
    train(stores, 4)
    with torch.no_grad():
        model.weight += 0.5
    torch.save(state(model, stores, 4), directory + ".new")
    count = hook(limit)
    chains.save(model, [opt], stores, 4)
    with REAL_OPEN(directory + ".done", "w") as fh:
        fh.write(str(count[0]))
    os._exit(0)


results = {"kills": 0, "hangs": 0, "completed_at": None}
for limit in range(1, 400):
    directory = os.path.join(ROOT, f"k{limit:03d}")
    pid = os.fork()
    if pid == 0:
        try:
            child(directory, limit)
        finally:
            os._exit(3)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            results["hangs"] += 1
            status = None
            break
        time.sleep(0.01)
    if status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        results["kills"] += 1
        continue
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    results["completed_at"] = limit
    break
print(json.dumps(results))
'''

_KILL_CHECK = r'''
import json, os, sys
import numpy as np
import torch
import cncore
from cncore_torch.dlrm.chains import TableChains, open_checkpoint
from cncore_torch.dlrm.data import InputError

ROOT = sys.argv[1]
FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")


def same(got, want):
    if int(got["step"]) != int(want["step"]):
        return False
    for k, v in want["dense"].items():
        if not torch.equal(got["model"][k], v):
            return False
    for name in ("t_a", "t_b"):
        p = f"sparse.{name}."
        a, b = got["model"], want
        oa, ob = np.argsort(a[p + "keys"].numpy()), np.argsort(b[p + "keys"].numpy())
        for f in FIELDS:
            if not np.array_equal(a[p + f].numpy()[oa], b[p + f].numpy()[ob]):
                return False
        if int(a[p + "step"]) != int(b[p + "step"]):
            return False
    return True


out = {"cases": 0, "previous": 0, "new": 0, "refused": 0, "wrong": [], "resaved": 0}
for entry in sorted(os.listdir(ROOT)):
    directory = os.path.join(ROOT, entry)
    if not os.path.isdir(directory) or not entry.startswith("k"):
        continue
    out["cases"] += 1
    prev = torch.load(directory + ".prev", weights_only=False)
    new = torch.load(directory + ".new", weights_only=False)
    try:
        got = open_checkpoint(directory, "sparse.")
    except InputError as e:
        out["refused"] += 1
        out["wrong"].append(f"{entry}: refused: {e}")
        continue
    if same(got, prev):
        out["previous"] += 1
    elif same(got, new):
        out["new"] += 1
    else:
        out["wrong"].append(f"{entry}: neither the previous save nor the new one")
        continue
    # resume: the stores from the checkpoint, trained on and saved again into the same directory
    stores = {}
    for name in ("t_a", "t_b"):
        p = f"sparse.{name}."
        s = cncore.EmbeddingStore(dim=2, optimizer=cncore.Adagrad(lr=0.1), max_rows=40, eviction=cncore.LRU())
        m = got["model"]
        s.load(m[p + "keys"].numpy(), m[p + "rows"].numpy(), m[p + "optimizer_state"].numpy(),
               m[p + "counts"].numpy(), m[p + "last_steps"].numpy())
        s.step = int(m[p + "step"])
        stores[name] = s
    model = torch.nn.Linear(3, 1)
    model.load_state_dict({k: got["model"][k] for k in ("weight", "bias")})
    TableChains(directory, 1).save(model, [torch.optim.SGD(model.parameters(), lr=0.1)], stores, got["step"] + 1)
    again = open_checkpoint(directory, "sparse.")
    for name, s in stores.items():
        p = f"sparse.{name}."
        if sorted(again["model"][p + "keys"].tolist()) != sorted(s.export().keys.tolist()):
            out["wrong"].append(f"{entry}: the save after resuming did not read back")
    out["resaved"] += 1
print(json.dumps(out))
'''


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["delta", "base"])
def test_a_save_killed_at_any_file_operation_resumes_from_the_previous_or_the_new_checkpoint(tmp_path, scenario):
    """cn-dlrm's chains (TableChains, two bounded tables): three saves, then a fourth (a delta;
    or, as a resumed run's first save, a base) killed with SIGKILL just before its 1st, 2nd,
    ... file operation (every rename, replace, remove, fsync, mkdir, rmtree and file opened
    for writing), until a run gets through. Each directory left behind opens
    (`open_checkpoint`, what --resume reads) as exactly the third save or the fourth, and
    takes another save after resuming."""
    import subprocess
    import sys
    root = str(tmp_path)
    driver = subprocess.run([sys.executable, "-c", _KILL_DRIVER, root, scenario], capture_output=True, text=True,
                            timeout=600)
    assert driver.returncode == 0, driver.stderr[-3000:]
    kills = json.loads(driver.stdout.strip().splitlines()[-1])
    assert kills["hangs"] == 0 and kills["completed_at"] is not None and kills["kills"] >= 20, kills
    check = subprocess.run([sys.executable, "-c", _KILL_CHECK, root], capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    out = json.loads(check.stdout.strip().splitlines()[-1])
    print(f"\nkilled {scenario} save: {kills}, resumed: {out}")
    assert out["wrong"] == [], out["wrong"][:5]
    assert out["cases"] == kills["kills"] + 1 and out["previous"] + out["new"] == out["cases"] == out["resaved"]
    assert out["previous"] >= 10 and out["new"] >= 1
