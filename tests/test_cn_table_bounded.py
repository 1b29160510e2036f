"""cn-table over bounded tables and delta chains: inspect shows the policy the config holds,
refuses a chain in one line that says to compact it; compact writes exactly what load_store
reads from the chain, leaves a table that is not a chain alone, and refuses a damaged chain
in one line with exit 2, the table unchanged."""
import json
import os
import re

import numpy as np
import pytest
from reference import snapshot, tree
from test_bounded_checkpoints import train  # the same training step
from test_cn_table import refused  # the same one-line refusal check

import cncore
from cncore.tablefile import TableFormatError, config_to_dict, load_store, open_table, save_table
from cncore_numpy.cli import main

POLICIES = {
    "lru": dict(max_rows=300, eviction=cncore.LRU()),
    "lfu+headroom": dict(max_rows=300, eviction=cncore.LFU(), headroom=7),
    "ttl+admission": dict(max_rows=300, eviction=cncore.TTL(5),
                          admission=cncore.MinCount(2, unadmitted="initial", width=1024, depth=3)),
    "ttl unbounded": dict(eviction=cncore.TTL(9)),
}


def bounded(**policy):
    return cncore.EmbeddingStore(dim=3, seed=2, optimizer=cncore.RowWiseAdagrad(lr=0.1),
                                 fallback_rows=0, **(policy or POLICIES["lru"]))


@pytest.fixture
def chain(tmp_path):
    """(path, store): a base and two deltas of a bounded store, rows evicted, erased and trained between."""
    path = str(tmp_path / "t")
    s = bounded()
    train(s, np.arange(200))
    base = save_table(s, path)
    train(s, np.arange(150, 400))       # past the budget: evicts
    assert s.evicted_count > 0
    d1 = save_table(s, path, since=base)
    s.erase(np.arange(380, 390))
    train(s, np.arange(0, 40))
    d2 = save_table(s, path, since=d1)
    assert d1.delta and d2.delta and d2.chain == 2
    return path, s


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_inspect_shows_the_policy_the_config_holds(tmp_path, capsys, name):
    path = str(tmp_path / "t")
    s = bounded(**POLICIES[name])
    _ = s.find_or_insert(np.arange(50))
    s.evict(7)
    save_table(s, path)
    expected = config_to_dict(s.config)
    assert main(["inspect", path, "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for field in ("max_rows", "eviction", "headroom", "admission"):
        assert summary[field] == expected.get(field), field
    assert summary["evicted_count"] == s.evicted_count == 7
    assert main(["inspect", path, "--quiet"]) == 0
    policy = [line for line in capsys.readouterr().out.splitlines() if line.startswith("policy: ")]
    c = s.config
    assert policy == [f"policy: max_rows {c.max_rows}, eviction {c.eviction!r}, headroom {c.headroom}, "
                      f"admission {c.admission!r}; 7 rows evicted so far"]


def test_inspect_of_an_unbounded_table_shows_no_policy(tmp_path, capsys):
    path = str(tmp_path / "t")
    s = cncore.EmbeddingStore(dim=3)
    _ = s.find_or_insert(np.arange(5))
    save_table(s, path)
    assert main(["inspect", path, "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [summary[f] for f in ("max_rows", "eviction", "headroom", "admission")] == [None] * 4
    assert main(["inspect", path, "--quiet"]) == 0
    assert "policy" not in capsys.readouterr().out


def test_the_tools_refuse_a_chain_saying_to_compact_it(chain, tmp_path, capsys):
    path, _ = chain
    before = tree(path)
    for argv in (["inspect", path], ["inspect", path, "--json"], ["export", path, str(tmp_path / "e.npz")],
                 ["prune", path, str(tmp_path / "p"), "--min-count", "1"]):
        refused(argv, capsys, re.escape(f"{path}: a chain of a base and 2 deltas (incremental saves); "
                                        f"run `cn-table compact {path}` first"))
    assert tree(path) == before and not os.path.exists(tmp_path / "p") and not os.path.exists(tmp_path / "e.npz")


def assert_same(got, want):
    """Two snapshots (len, keys, rows, state, counts, last steps, step) equal bit for bit."""
    assert got[0] == want[0] and got[6] == want[6]
    for a, b in zip(got[1:6], want[1:6]):
        np.testing.assert_array_equal(a, b)


def test_compact_in_place_writes_what_load_store_reads_from_the_chain(chain, capsys):
    path, s = chain
    want = snapshot(load_store(path))
    assert_same(want, snapshot(s))  # the chain is the store (the core's own promise, checked once here)
    assert main(["compact", path, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out == f"wrote {len(s):,} rows to {path} (2 deltas merged into one version)\n"
    table = open_table(path)  # one version now: maps
    assert table.delta is None and table.config == s.config
    assert sorted(os.listdir(path)) == ["CURRENT", table.version]
    assert_same(snapshot(load_store(path)), want)
    assert main(["inspect", path, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["max_rows"] == 300


def test_compact_to_out_leaves_the_chain(chain, tmp_path, capsys):
    path, s = chain
    before = tree(path)
    out = str(tmp_path / "merged")
    assert main(["compact", path, out, "--quiet"]) == 0
    assert capsys.readouterr().out == (f"wrote {len(s):,} rows to {out} (2 deltas merged into one version; "
                                       f"{path} left as it is)\n")
    assert tree(path) == before
    assert open_table(out).delta is None
    assert_same(snapshot(load_store(out)), snapshot(load_store(path)))


def test_compact_of_a_table_saved_in_full_leaves_it_alone(tmp_path, capsys):
    path = str(tmp_path / "t")
    s = bounded()
    train(s, np.arange(100))
    save_table(s, path)
    before = tree(path)
    assert main(["compact", path, "--quiet"]) == 0
    assert capsys.readouterr().out == f"{path}: not a chain (one full version, 100 rows); left as it is\n"
    assert tree(path) == before
    assert main(["compact", path, path, "--quiet"]) == 0  # OUT naming TABLE: in place
    assert tree(path) == before
    capsys.readouterr()
    out = str(tmp_path / "copy")
    assert main(["compact", path, out, "--quiet"]) == 0
    assert capsys.readouterr().out == f"wrote 100 rows to {out} (not a chain; {path} left as it is)\n"
    assert_same(snapshot(load_store(out)), snapshot(s))


def damage_removed_keys(path, version):
    file = os.path.join(path, version, "removed_keys.npy")
    os.chmod(file, 0o644)
    with open(file, "r+b") as fh:
        fh.seek(-1, 2)
        byte = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([byte[0] ^ 0xFF]))


def versions(path):
    return sorted(e for e in os.listdir(path) if re.fullmatch(r"v[0-9]+", e))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated delta", "missing base", "bad parent"])
def test_compact_refuses_a_damaged_chain_and_changes_nothing(chain, tmp_path, capsys, damage):
    path, _ = chain
    base, d1, d2 = versions(path)
    if damage == "flipped byte":
        damage_removed_keys(path, d1)
        message = f"{d1}/removed_keys.npy fails its SHA-256 check"
    elif damage == "truncated delta":
        file = os.path.join(path, d2, "rows.npy")
        os.chmod(file, 0o644)
        os.truncate(file, os.path.getsize(file) - 4)
        message = f"{d2}/rows.npy has .* bytes, the manifest says"
    elif damage == "missing base":
        os.rename(os.path.join(path, base), str(tmp_path / "elsewhere"))
        message = f"{base}/manifest.json is missing"
    else:  # the head names itself as parent, with a matching manifest checksum
        import hashlib
        manifest = os.path.join(path, d2, "manifest.json")
        m = json.loads(open(manifest).read())
        m["delta"]["parent"] = d2
        text = json.dumps(m).encode()
        for name, data in (("manifest.json", text), ("manifest.sha256",
                                                     f"{hashlib.sha256(text).hexdigest()}  manifest.json\n".encode())):
            os.chmod(os.path.join(path, d2, name), 0o644)
            open(os.path.join(path, d2, name), "wb").write(data)
        message = f"names parent {d2}, not an earlier version"
    before = tree(path)
    for argv in (["compact", path], ["compact", path, str(tmp_path / "out")]):
        refused(argv, capsys, message)
        assert tree(path) == before and not os.path.exists(tmp_path / "out")
    with pytest.raises(TableFormatError):  # the core agrees
        load_store(path)
