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
import re
import shutil

import numpy as np
import pytest
from reference import snapshot, tree

import cncore
from cncore.routing import owner_of, shard_name
from cncore.tablefile import TableFormatError, compact_table, load_store, save_table

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


@pytest.mark.slow
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
from cn_dlrm.chains import TableChains

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
from cn_dlrm.chains import TableChains, open_checkpoint
from cn_dlrm.options import InputError

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


# --- sharded collections: shard files and state_dicts of two real ranks, mixed -----------------------

SPAWN_TIMEOUT = 150.0
SOURCES = ("A3", "A5", "B3")  # run A at step 3 and step 5, run B (another run, the same steps) at step 3


def _collection(device, budget=None):
    from torchrec import EmbeddingBagConfig

    from cncore_torch import CNEmbeddingBagCollection
    return CNEmbeddingBagCollection([EmbeddingBagConfig(name="t_a", embedding_dim=3, num_embeddings=1000,
                                                        feature_names=["fa"])],
                                    device=device, optimizer=cncore.Adagrad(lr=0.1), seed=3, max_rows=budget,
                                    eviction=cncore.LRU() if budget else None)


def _dmp(budget=None):
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, plan_for
    model = torch.nn.Sequential(_collection("meta", budget))
    return DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()],
                                    plan=plan_for(model, dist.get_world_size()))


def _train_dmp(dmp, rank, steps, salt):
    import torch
    from torchrec import KeyedJaggedTensor
    for step in steps:
        ids = np.random.default_rng(salt + 10 * step + rank).integers(0, 200, 16)
        kjt = KeyedJaggedTensor.from_lengths_sync(["fa"], torch.from_numpy(ids), torch.ones(16, dtype=torch.int64))
        dmp(kjt).wait().values().sum().backward()


def _save_runs(rank, world_size, folder):
    """Run A saves shard files and state_dicts at step 3 and 5, run B (a second sharded module,
    trained on other IDs) at step 3; rank 0 keeps every rank's state_dicts."""
    import torch
    import torch.distributed as dist

    from cncore_torch.distributed.checkpoint import save_shard_tables

    runs = {}
    for run, salt in (("A", 0), ("B", 5000)):
        dmp = _dmp()
        runs[run] = getattr(dmp.module[0], "_run_id", None)
        _train_dmp(dmp, rank, range(3), salt)
        saves = [("3", None), ("5", range(3, 5))] if run == "A" else [("3", None)]
        for step, more in saves:
            if more is not None:
                _train_dmp(dmp, rank, more, salt)
            save_shard_tables(dmp.module[0], os.path.join(folder, run + step))
            everyone = [None] * world_size
            dist.all_gather_object(everyone, dmp.module[0].state_dict())
            if rank == 0:
                torch.save(everyone, os.path.join(folder, f"{run}{step}_sd.pt"))
    ids = [None] * world_size
    dist.all_gather_object(ids, runs)
    if rank == 0:
        with open(os.path.join(folder, "run_ids.json"), "w") as fh:
            json.dump(ids, fh)


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    pytest.importorskip("torchrec")
    from cncore_torch.distributed.launch import spawn
    folder = str(tmp_path_factory.mktemp("runs"))
    spawn(_save_runs, 2, folder, timeout=SPAWN_TIMEOUT)
    return folder


def _state_dicts(folder, source):
    import torch
    return torch.load(os.path.join(folder, f"{source}_sd.pt"), weights_only=False)


def _table(entries, prefix="tables.t_a."):
    keys = entries[prefix + "keys"].numpy()
    order = np.argsort(keys)
    return {f: entries[prefix + f].numpy()[order] for f in FIELDS}, int(entries[prefix + "step"])


def _store_table(store):
    e = store.export()
    order = np.argsort(e.keys)
    return {f: (np.asarray(getattr(e, f))[order].astype(np.int64) if f in ("counts", "last_steps")
                else np.asarray(getattr(e, f))[order]) for f in FIELDS}, store.step


def _equal(a, b) -> bool:
    return a[1] == b[1] and all(np.array_equal(a[0][f], b[0][f]) for f in FIELDS)


@pytest.mark.slow
def test_shard_state_dicts_say_rank_world_size_and_run(saved_runs):
    ids = json.load(open(os.path.join(saved_runs, "run_ids.json")))
    assert ids[0] == ids[1] and ids[0]["A"] != ids[0]["B"] and ids[0]["A"] is not None  # both ranks agree, per run
    sd = _state_dicts(saved_runs, "A3")
    a, b = sd[0]["tables.t_a.shard"].tolist(), sd[1]["tables.t_a.shard"].tolist()
    other = _state_dicts(saved_runs, "B3")[0]["tables.t_a.shard"].tolist()
    assert a[:2] == [0, 2] and b[:2] == [1, 2] and a[2] == b[2] != other[2]


@pytest.mark.slow
def test_merge_shards_refuses_a_missing_or_foreign_rank_and_loads_refuse_a_partial_table(saved_runs):
    from cncore_torch.distributed import merge_shards
    a3, a5, b3 = (_state_dicts(saved_runs, s) for s in SOURCES)
    with pytest.raises(ValueError, match=r"^tables\.t_a\.shard: rank 1 of 2 missing: a table split over 2 ranks needs "
                                         r"every rank's state_dict, 1 given; nothing was merged$"):
        merge_shards([a3[0]])
    with pytest.raises(ValueError, match=r"^state_dicts\[1\]: tables\.t_a\.shard: rank 1 of 2 of run [0-9a-f]+, "
                                         r"but state_dicts\[0\] is rank 0 of 2 of run [0-9a-f]+: shards of different "
                                         r"saves"):
        merge_shards([a3[0], b3[1]])
    with pytest.raises(ValueError, match="the shards disagree"):  # one run, two steps
        merge_shards([a3[0], a5[1]])
    with pytest.raises(ValueError, match=r"rank 0 of 2 given twice \(also as state_dicts\[0\]\)"):
        merge_shards([a3[0], a3[0], a3[1]])
    merged = merge_shards([a3[1], a3[0]])
    assert merged["tables.t_a.shard"].tolist()[:2] == [0, 1]
    # one rank's state_dict straight into one process: refused, the table as it was
    single = _collection("cpu")
    with pytest.raises(RuntimeError, match=r"tables\.t_a\.shard: these entries are rank 0's shard of a table split "
                                           r"over 2 ranks .* this table is rank 0 of 1"):
        single.load_state_dict(a3[0])
    assert len(single.stores["t_a"]) == 0
    single.load_state_dict(merged)
    assert _equal(_store_table(single.stores["t_a"]), _table(merged))


def _case_folders(folder, strip):
    """Every way of filling the two shard places of table t_a from the three saves: each place
    gets a save's own file for that place, the other place's file (renamed), or nothing.
    `strip`: the files' shard records removed (as written before they were recorded).
    Returns [(case folder, expected source or None for a refusal, description)]."""
    import hashlib
    import itertools
    cases = []
    options = [(s, w) for s in SOURCES for w in ("own", "other")] + [(None, "missing")]
    for n, slots in enumerate(itertools.product(options, repeat=2)):
        case = os.path.join(folder, f"{'legacy' if strip else 'cases'}", f"c{n:03d}")
        os.makedirs(os.path.join(case, "t_a"))
        for r, (source, which) in enumerate(slots):
            if source is None:
                continue
            src = os.path.join(folder, source, "t_a", shard_name(r if which == "own" else 1 - r, 2))
            dst = os.path.join(case, "t_a", shard_name(r, 2))
            shutil.copytree(src, dst)
            if strip:
                version = open(os.path.join(dst, "CURRENT")).read().strip()
                m = json.load(open(os.path.join(dst, version, "manifest.json")))
                m.pop("shard", None)
                text = json.dumps(m, indent=1).encode()
                for name, data in (("manifest.json", text), ("manifest.sha256",
                                   f"{hashlib.sha256(text).hexdigest()}  manifest.json\n".encode())):
                    os.chmod(os.path.join(dst, version, name), 0o644)
                    open(os.path.join(dst, version, name), "wb").write(data)
        whole = all(s is not None and w == "own" for s, w in slots)
        one_save = whole and slots[0][0] == slots[1][0]
        same_step = whole and {slots[0][0][1], slots[1][0][1]} in ({"3"}, {"5"})
        expect = (slots[0][0] if one_save else None) if not strip else (
            "per-file" if same_step else None)  # without records: a same-step mix loads each file as it is
        cases.append((case, expect, f"{slots[0]} + {slots[1]}"))
    return cases


def _load_cases(rank, world_size, folder, cases):
    """Each case loaded on this rank (load_shard_tables), and each saved state_dict; the outcome
    compared with the saved rows; JSON counts per rank."""
    import torch

    from cncore_torch.distributed import merge_shards
    from cncore_torch.distributed.checkpoint import load_shard_tables

    wants = {s: merge_shards(torch.load(os.path.join(folder, f"{s}_sd.pt"), weights_only=False)) for s in SOURCES}
    own = {s: dict(torch.load(os.path.join(folder, f"{s}_sd.pt"), weights_only=False)[rank].items())
           for s in SOURCES}
    dmp = _dmp()
    _train_dmp(dmp, rank, range(2), 9000)  # rows of its own, to see that a refusal keeps them
    module = dmp.module[0]
    store = module.stores["t_a"]
    out = {"cases": 0, "exact": 0, "refused": 0, "silent": [], "crashes": [], "per_file": 0, "messages": {}}

    def mine(entries):
        table, step = _table(entries)
        keep = owner_of(table["keys"], world_size) == rank
        return {f: v[keep] for f, v in table.items()}, step

    for case, expect, what in cases:
        out["cases"] += 1
        before, files = _store_table(store), tree(case)
        try:
            load_shard_tables(module, case)
        except ValueError as e:
            if _equal(_store_table(store), before) and tree(case) == files:
                out["refused"] += 1
                out["messages"][case] = str(e)
            else:
                out["silent"].append(f"{what}: refused but changed something")
            if expect is not None:
                out["silent"].append(f"{what}: refused, expected {expect}: {e}")
            continue
        except Exception as e:  # anything else is a crash to report
            out["crashes"].append(f"{what}: {type(e).__name__}: {e}")
            continue
        got = _store_table(store)
        if expect == "per-file":
            out["per_file"] += 1
            path = os.path.join(case, "t_a", shard_name(rank, 2))
            want = load_store(path)
            if not _equal(got, _store_table(want)):
                out["silent"].append(f"{what}: not its own file's rows")
        elif expect is None or not _equal(got, mine(wants[expect])):
            out["silent"].append(f"{what}: loaded, expected {expect}")
        else:
            out["exact"] += 1
    # state_dicts: this rank's own loads; the other rank's, and a merged one of two saves, do not
    for s in SOURCES:
        for r in range(world_size):
            sd = torch.load(os.path.join(folder, f"{s}_sd.pt"), weights_only=False)[r]
            out["cases"] += 1
            before = _store_table(store)
            try:
                module.load_state_dict(sd)
            except RuntimeError as e:
                if r != rank and _equal(_store_table(store), before):
                    out["refused"] += 1
                else:
                    out["silent"].append(f"{s} rank {r}'s state_dict refused on rank {rank}: {e}")
                continue
            if r == rank and _equal(_store_table(store), mine(own[s])):
                out["exact"] += 1
            else:
                out["silent"].append(f"{s} rank {r}'s state_dict loaded on rank {rank}")
    # a budget too small for the files: every rank refuses, whichever rank's share is over it
    out["budget"] = {}
    small = _dmp(budget=20)  # 10 rows a rank
    small.module[0].stores["t_a"].find_or_insert(np.array([rank]))  # a row of its own, to see it stay
    for source in ("A3", "one"):  # as many files as ranks; one file re-split over the two ranks
        before = _store_table(small.module[0].stores["t_a"])
        try:
            load_shard_tables(small.module[0], os.path.join(folder, source))
            out["budget"][source] = "loaded"
        except ValueError as e:
            same = _equal(_store_table(small.module[0].stores["t_a"]), before)
            out["budget"][source] = str(e) if same else "refused but changed"
    with open(os.path.join(folder, f"outcome{rank}.json"), "w") as fh:
        json.dump(out, fh)


@pytest.mark.slow
def test_every_mix_of_shard_files_loads_exactly_one_save_or_is_refused_on_every_rank(saved_runs):
    """Harness: the 49 ways of filling two shard places from three saves (own file, the other
    rank's, none), with the files' records and without (files written before records), loaded
    on two real ranks; and every rank's state_dict on every rank. Every outcome is exactly the
    saved rows of one save, or a refusal that leaves the table and the files as they were."""
    from cncore_numpy.cli import main as cn_table
    from cncore_torch.distributed.launch import spawn
    cases = _case_folders(saved_runs, strip=False) + _case_folders(saved_runs, strip=True)
    assert cn_table(["reshard", *(os.path.join(saved_runs, "A3", "t_a", shard_name(r, 2)) for r in range(2)),
                     os.path.join(saved_runs, "one", "t_a"), "--world-size", "1", "--quiet"]) == 0
    spawn(_load_cases, 2, saved_runs, cases, timeout=SPAWN_TIMEOUT)
    outcomes = [json.load(open(os.path.join(saved_runs, f"outcome{r}.json"))) for r in range(2)]
    counts = {k: sum(len(o[k]) if isinstance(o[k], list) else o[k] for o in outcomes)
              for k in ("cases", "exact", "refused", "per_file", "silent", "crashes")}
    print(f"\nshard harness (2 ranks, {len(cases)} file cases + 6 state_dicts each): {counts}")
    for o in outcomes:
        assert o["silent"] == [] and o["crashes"] == [], (o["silent"][:5], o["crashes"][:5])
    # Per rank. With records: the 3 intact saves load exactly, the other 46 mixes are refused.
    # Without (older files): the 5 same-step sets of own files load each file as it is (a mix
    # of two runs at one step cannot be told apart without records), the other 44 are refused.
    # State_dicts: each save's own rank loads exactly, the other rank's is refused.
    assert [e for _, e, _ in cases[:49]].count(None) == 46 and [e for _, e, _ in cases[49:]].count("per-file") == 5
    assert counts == {"cases": 2 * 104, "exact": 2 * 6, "refused": 2 * 93, "per_file": 2 * 5, "silent": 0,
                      "crashes": 0}
    # what the refusals say, on both ranks alike (folders: shard places filled as described)
    named = {what: case for case, _, what in cases[:49]}
    own = lambda s: f"('{s}', 'own')"  # noqa: E731
    other = lambda s: f"('{s}', 'other')"  # noqa: E731
    for o in outcomes:
        assert o["messages"][named[f"{own('A3')} + {own('A5')}"]].endswith(
            "t_a: the shards disagree on the step (shard-0-of-2: 3, shard-1-of-2: 5); were they saved at one step? "
            "nothing was loaded")
        assert re.search(r"t_a: the shard files are of different saves \(shard-0-of-2: [0-9a-f]{16}-step3, "
                         r"shard-1-of-2: [0-9a-f]{16}-step3\); keep one save's shards in a directory; nothing was "
                         r"loaded$", o["messages"][named[f"{own('A3')} + {own('B3')}"]])
        assert o["messages"][named[f"{other('A3')} + {other('A3')}"]].endswith(
            "t_a/shard-0-of-2: was saved as shard 1 of 2, not shard 0 of 2: shard folders were renamed or moved; put "
            "each back under its own name (shard-1-of-2); nothing was loaded or written")
        assert re.fullmatch(rf"{re.escape(os.path.join(saved_runs, 'A3', 't_a'))}/shard-[01]-of-2: holds \d+ rows, "
                            r"more than table 't_a''s max_rows per rank \(10\) here; build the module with a larger "
                            r"max_rows; nothing was loaded", o["budget"]["A3"]), o["budget"]
        t_a = re.escape(os.path.join(saved_runs, "one", "t_a"))
        assert re.fullmatch(rf"{t_a}: rank [01] of 2 would hold \d+ rows, "
                            r"more than table 't_a''s max_rows per rank \(10\); build the module with a larger "
                            r"max_rows \(or reshard with cn-table reshard --max-rows\); nothing was loaded",
                            o["budget"]["one"]), o["budget"]
    assert outcomes[0]["budget"] == outcomes[1]["budget"]  # both ranks refuse, naming the same file and rank
    for o in outcomes:
        legacy = {what: case for case, _, what in cases[49:]}
        assert re.search(r"t_a/shard-0-of-2: holds key -?\d+, which shard 1 of 2 owns, not 0: not shard 0 of a 2-way "
                         r"split", o["messages"][legacy[f"{other('A3')} + {other('A3')}"]])


# --- table names are directory names -----------------------------------------------------------------

BAD_NAMES = ["../x", "ABSOLUTE", "a/b", "..", ".", "", "a\\b", "a\0b"]  # ABSOLUTE: a path under tmp_path
MODULE_NAME_REFUSAL = (r"^table name {}: a collection holds a module per table under its name "
                       r"\(embedding_bags\[name\], "
                       r"as TorchRec's collections do\), so a table name is a non-empty string without '\.'; rename "
                       r"the table$")


def _not_a_module_name(name):
    """Names a collection refuses when it is built (TorchRec's ModuleDict of tables cannot hold them)."""
    return name == "" or "." in name


def _named_collection(name, **options):
    from torchrec import EmbeddingBagConfig

    from cncore_torch import CNEmbeddingBagCollection
    return CNEmbeddingBagCollection([EmbeddingBagConfig(name=name, embedding_dim=2, num_embeddings=10,
                                                        feature_names=["f"])],
                                    optimizer=cncore.SGD(lr=0.1), **options)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_save_shard_tables_refuses_a_table_name_that_is_not_one_path_component(tmp_path, name):
    pytest.importorskip("torchrec")
    from cncore_torch.distributed.checkpoint import save_shard_tables
    name = str(tmp_path / "abs") if name == "ABSOLUTE" else name
    if _not_a_module_name(name):
        with pytest.raises(ValueError, match=MODULE_NAME_REFUSAL.format(re.escape(repr(name)))):
            _named_collection(name)
        return
    module = _named_collection(name)
    out = tmp_path / "inner" / "files"
    os.makedirs(out)
    before = tree(tmp_path)
    with pytest.raises(ValueError, match=f"^table name {re.escape(repr(name))}: is used as a directory name, so it "
                                         r"must be one plain path component \(not empty, '\.' or '\.\.', no '/', "
                                         r"'\\' or NUL\); rename the table; nothing was written$"):
        save_shard_tables(module, str(out))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_tiered_collection_refuses_a_table_name_that_is_not_one_path_component(tmp_path, name):
    pytest.importorskip("torchrec")
    name = str(tmp_path / "abs") if name == "ABSOLUTE" else name
    before = tree(tmp_path)
    # The tier's directory is checked first (before the module names): every bad name gets its refusal.
    with pytest.raises(ValueError, match=f"^table name {re.escape(repr(name))}: is used as a directory name"):
        _named_collection(name, storage=cncore.Tiered(str(tmp_path / "tier"), cache_bytes=1 << 20))
    assert tree(tmp_path) == before  # not even the collection's directory


def test_table_names_that_are_one_path_component_still_save(tmp_path):
    pytest.importorskip("torchrec")
    from cncore_torch.distributed.checkpoint import load_shard_tables, save_shard_tables
    module = _named_collection("t_user-1 x")
    module.stores["t_user-1 x"].find_or_insert(np.arange(4))
    assert save_shard_tables(module, str(tmp_path)) == [str(tmp_path / "t_user-1 x" / "shard-0-of-1")]
    back = _named_collection("t_user-1 x")
    load_shard_tables(back, str(tmp_path))
    assert sorted(back.stores["t_user-1 x"].export().keys.tolist()) == [0, 1, 2, 3]


# --- cn-table reshard --max-rows on an unbounded table -----------------------------------------------

def test_cn_table_reshard_max_rows_of_an_unbounded_table_says_so_in_the_cli_terms(tmp_path, capsys):
    from cncore_numpy.cli import main as cn_table
    paths = []
    for r in range(2):
        store = cncore.EmbeddingStore(dim=2)
        keys = np.arange(50)
        store.find_or_insert(keys[owner_of(keys, 2) == r])
        paths.append(str(tmp_path / shard_name(r, 2)))
        save_table(store, paths[-1])
    before = tree(tmp_path)
    assert cn_table(["reshard", *paths, str(tmp_path / "out"), "--world-size", "3", "--max-rows", "10", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cn-table reshard: error: --max-rows 10: {paths[0]} is a shard of an unbounded table (no "
                   f"max_rows), which has no row budget to set; leave --max-rows out"]
    assert tree(tmp_path) == before


# --- cn-dlrm's chains on two ranks: one rank killed during a save ------------------------------------

def _chain_ranks(rank, world_size, folder, victim, limit):
    """Two ranks save their shards as chains (TableChains, as cn-dlrm --nproc 2) three times;
    in the fourth save, rank `victim` is killed (SIGKILL) before its limit-th file operation."""
    import builtins
    import signal

    import torch

    from cn_dlrm.chains import TableChains
    from cncore_torch.state import save_store

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stores = {n: cncore.EmbeddingStore(dim=2, optimizer=cncore.Adagrad(lr=0.1), seed=i + 1)
              for i, n in enumerate(("t_a", "t_b"))}

    def train(step):
        for i, store in enumerate(stores.values()):
            keys = np.random.default_rng(step * 10 + i).integers(0, 80, 24)
            keys = keys[owner_of(keys, world_size) == rank]
            _, ctx = store.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64))
            store.apply_gradients(ctx, np.ones((len(keys), 2), np.float32))

    def state(step):
        out = {"step": step}
        for name, store in stores.items():
            save_store(store, out, f"sparse.{name}.")
        return out

    chains = TableChains(folder, 1, rank, world_size)
    for step in range(1, 4):
        train(step)
        chains.save(model, [opt], stores, step)
    torch.save(state(3), f"{folder}.prev{rank}")
    train(4)
    torch.save(state(4), f"{folder}.new{rank}")
    if rank == victim:
        count = [0]

        def wrap(fn, writes_only=False):
            def inner(*args, **kwargs):
                mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
                if not writes_only or any(c in str(mode) for c in "wax+"):
                    count[0] += 1
                    if count[0] >= limit:
                        os.kill(os.getpid(), signal.SIGKILL)
                return fn(*args, **kwargs)
            return inner
        for mod, name in ((os, "rename"), (os, "replace"), (os, "remove"), (os, "rmdir"), (os, "fsync"),
                          (os, "makedirs"), (shutil, "rmtree")):
            setattr(mod, name, wrap(getattr(mod, name)))
        builtins.open = wrap(builtins.open, writes_only=True)
    chains.save(model, [opt], stores, 4)


_CHAIN_RANKS_CHECK = r'''
import json, sys
import numpy as np
import torch
from cn_dlrm.chains import open_checkpoint
from cn_dlrm.options import InputError

out = []
for case in json.loads(sys.argv[1]):
    try:
        got = open_checkpoint(case, "sparse.")
    except InputError as e:
        out.append(f"refused: {e}")
        continue
    found = None
    for which in ("prev", "new"):
        parts = [torch.load(f"{case}.{which}{r}", weights_only=False) for r in range(2)]
        same = int(got["step"]) == parts[0]["step"]
        for name in ("t_a", "t_b"):
            p = f"sparse.{name}."
            want = {f: np.concatenate([q[p + f].numpy() for q in parts]) for f in ("keys", "rows", "optimizer_state")}
            have = {f: got["model"][p + f].numpy() for f in want}
            a, b = np.argsort(have["keys"]), np.argsort(want["keys"])
            same = same and all(np.array_equal(have[f][a], want[f][b]) for f in want)
        if same:
            found = which
    out.append(found or "neither")
print(json.dumps(out))
'''


@pytest.mark.slow
def test_a_two_rank_save_with_one_rank_killed_resumes_from_the_previous_or_the_new_save(tmp_path):
    """cn-dlrm --nproc 2's chains: the fourth save, with rank 0 and rank 1 in turn killed before
    its 3rd, 12th, 21st, ... file operation (the other rank's collective then fails): the
    directory opens as exactly the third save (or the fourth, where the kill came after it
    completed). The victims alternate along the kill points (each spawn of two ranks costs
    ~12 s), so both ranks die early, midway and late in the save."""
    import subprocess
    import sys

    from cncore_torch.distributed.launch import spawn
    cases, outcomes = [], {}
    # the save takes about 60 file operations a rank: the last limit completes
    for i, limit in enumerate(range(3, 67, 9)):
        victim = i % 2
        case = str(tmp_path / f"r{victim}k{limit:02d}")
        try:
            spawn(_chain_ranks, 2, case, victim, limit, timeout=40.0)
            outcomes[case] = "completed"
        except TimeoutError:
            outcomes[case] = "hang"
        except Exception:  # the killed rank (and its peer's failed collective)
            outcomes[case] = "killed"
        cases.append(case)
    assert "hang" not in outcomes.values(), outcomes
    check = subprocess.run([sys.executable, "-c", _CHAIN_RANKS_CHECK, json.dumps(cases)], capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    opened = dict(zip(cases, json.loads(check.stdout.strip().splitlines()[-1])))
    print(f"\ntwo ranks, one killed: {sum(v == 'killed' for v in outcomes.values())} killed, "
          f"{sum(v == 'completed' for v in outcomes.values())} completed; opened as "
          f"{ {k: list(opened.values()).count(k) for k in set(opened.values())} }")
    for case in cases:
        expected = "new" if outcomes[case] == "completed" else "prev"
        assert opened[case] == expected, (case, outcomes[case], opened[case])
    killed = [c for c in cases if outcomes[c] == "killed"]
    assert len(killed) >= 5 and "completed" in outcomes.values(), outcomes
    assert {os.path.basename(c)[1] for c in killed} == {"0", "1"}, killed  # each rank died at least once


def test_checkpoint_to_tables_refuses_one_ranks_shard_and_writes_a_merged_one(saved_runs, tmp_path):
    from cncore_torch.checkpoint import checkpoint_to_tables, tables_to_checkpoint
    from cncore_torch.distributed import merge_shards
    a3 = _state_dicts(saved_runs, "A3")
    out = tmp_path / "tables"
    with pytest.raises(ValueError, match=r"^tables\.t_a\.shard: these entries are rank 1's shard of a table split over "
                                         r"2 ranks, not the whole table; merge every rank's state_dict"):
        checkpoint_to_tables(a3[1], str(out))
    assert not out.exists()
    assert checkpoint_to_tables(merge_shards(a3), str(out)) == ["tables.t_a"]
    back = tables_to_checkpoint(str(out))
    assert _equal(_table(back), _table(merge_shards(a3)))


def test_cn_table_reshard_refuses_shards_of_two_saves_and_renamed_shards(saved_runs, tmp_path, capsys):
    from cncore_numpy.cli import main as cn_table
    a = [os.path.join(saved_runs, "A3", "t_a", shard_name(r, 2)) for r in range(2)]
    b1 = os.path.join(saved_runs, "B3", "t_a", shard_name(1, 2))
    swapped = tmp_path / "swapped"
    for r in range(2):  # each folder under the other's name
        shutil.copytree(a[1 - r], swapped / shard_name(r, 2))
    before = tree(saved_runs), tree(tmp_path)
    assert cn_table(["reshard", a[0], b1, str(tmp_path / "out"), "--world-size", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"cn-table reshard: error: {re.escape(b1)}: written by save [0-9a-f]{{16}}-step3, {re.escape(a[0])} by "
        r"[0-9a-f]{16}-step3: shards of two saves; give the shards of one save; nothing was written", err[0]), err
    assert cn_table(["merge-shards", *(str(swapped / shard_name(r, 2)) for r in range(2)), str(tmp_path / "out"),
                     "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cn-table merge-shards: error: {swapped / shard_name(0, 2)}: was saved as shard 1 of 2, "
                   f"not shard 0 "
                   f"of 2: shard folders were renamed or moved; put each back under its own name (shard-1-of-2); "
                   f"nothing was loaded or written"]
    assert (tree(saved_runs), tree(tmp_path)) == before
    assert cn_table(["reshard", *a, str(tmp_path / "out"), "--world-size", "3", "--quiet"]) == 0  # one save: fine


def test_cn_dlrm_chains_refuse_a_table_name_that_is_not_one_path_component(tmp_path):
    import torch

    from cn_dlrm.chains import TableChains
    store = cncore.EmbeddingStore(dim=2)
    store.find_or_insert(np.arange(3))
    with pytest.raises(ValueError, match=r"^table name '\.\./x': is used as a directory name"):
        TableChains(str(tmp_path / "ck"), 1).save(torch.nn.Linear(1, 1), [], {"ok": store, "../x": store}, 1)
    assert tree(tmp_path) == {}
