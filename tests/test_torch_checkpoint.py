"""Torch checkpoints and table files convert into each other without loss."""

import numpy as np
import pytest
import torch
from reference import EDGE_KEYS, tree

import cncore
import cncore_torch
from cncore_numpy import load_table, open_table, save_table
from cncore_numpy.cli import main as cn_table
from cncore_torch.checkpoint import checkpoint_to_tables, table_configs, table_prefixes, tables_to_checkpoint
from cncore_torch.state import FIELDS


def trained_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({
        "users": cncore_torch.CNEmbeddingBag(100, 4, mode="mean", optimizer=cncore.RowWiseAdagrad(lr=0.1)),
        "ads": cncore_torch.CNEmbedding(100, 3, optimizer=cncore.Adam(lr=0.01)),
        "dense": torch.nn.Linear(4, 1),
    })
    ids = torch.tensor(EDGE_KEYS + [5, 6, 5])
    for _ in range(3):
        loss = model["users"](ids, torch.tensor([0, 3])).sum() + model["ads"](ids).pow(2).sum()
        loss.backward()
    return model


def assert_state_dicts_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def table_entries(state: dict) -> dict:
    """The entries of a state_dict that belong to dynamic tables."""
    return {k: v for k, v in state.items() if any(k.startswith(p) and k[len(p):] in FIELDS + ("step",)
                                                  for p in table_prefixes(state))}


def test_modules_round_trip_through_table_files(tmp_path):
    model = trained_model()
    state = model.state_dict()
    assert sorted(table_prefixes(state)) == ["ads.", "users."]
    names = checkpoint_to_tables(state, str(tmp_path), table_configs(model))
    assert sorted(names) == ["ads", "users"]
    assert open_table(str(tmp_path / "users")).config == model["users"].config
    restored = tables_to_checkpoint(str(tmp_path))
    assert_state_dicts_equal(restored, table_entries(state))
    fresh = trained_model(seed=1)
    fresh.load_state_dict({**state, **restored})  # dense entries from torch, tables from the files
    assert_state_dicts_equal(fresh.state_dict(), state)
    fresh = trained_model(seed=1)
    fresh.load_state_dict(restored, strict=False)
    assert_state_dicts_equal(table_entries(fresh.state_dict()), table_entries(state))


def test_a_table_edited_offline_goes_back_into_a_model(tmp_path):
    model = trained_model()
    checkpoint_to_tables(model.state_dict(), str(tmp_path / "ckpt"), table_configs(model))
    assert cn_table(["prune", str(tmp_path / "ckpt" / "users"), str(tmp_path / "pruned" / "users"),
                     "--min-count", "4", "--quiet"]) == 0
    pruned = tables_to_checkpoint(str(tmp_path / "pruned"))
    model.load_state_dict(pruned, strict=False)
    table = load_table(str(tmp_path / "pruned" / "users"))
    kept = model["users"].keys().numpy()
    assert kept.tolist() == table.export().keys.tolist() == [5]  # the only ID seen twice a step
    np.testing.assert_array_equal(model["users"].store.lookup(kept), table.lookup(kept))


def test_a_table_file_becomes_a_bare_modules_state(tmp_path):
    """A table written by NumPy tools (no torch config) converts with an inferred config."""
    store = cncore.EmbeddingStore(dim=4, optimizer=cncore.RowWiseAdagrad())
    store.find_or_insert(np.array(EDGE_KEYS))
    store.step = 9
    bag = cncore_torch.CNEmbeddingBag(10, 4, optimizer=cncore.RowWiseAdagrad())
    save_table(store, str(tmp_path / "@root"))
    bag.load_state_dict(tables_to_checkpoint(str(tmp_path)), strict=False)
    assert sorted(bag.keys().tolist()) == sorted(EDGE_KEYS)
    written = checkpoint_to_tables(bag.state_dict(), str(tmp_path / "again"))
    assert written == ["@root"]
    again = open_table(str(tmp_path / "again" / "@root"))
    assert again.step == 9 and again.config.optimizer == cncore.RowWiseAdagrad()


def test_collections_round_trip(tmp_path):
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from cncore_torch import CNEmbeddingBagCollection
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=50, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1"])]
    ebc = CNEmbeddingBagCollection(tables=tables, optimizer=cncore.Adagrad(lr=0.1))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([1, 2**62, 3, -1]), torch.tensor([2, 0, 1, 1]))
    ebc(kjt).values().sum().backward()
    state = ebc.state_dict()
    checkpoint_to_tables(state, str(tmp_path), table_configs(ebc))
    assert sorted(p for p in table_prefixes(state)) == ["tables.t0.", "tables.t1."]
    assert_state_dicts_equal(tables_to_checkpoint(str(tmp_path)), table_entries(state))


def test_mismatched_config_is_refused(tmp_path):
    model = trained_model()
    with pytest.raises(ValueError, match="configs"):
        checkpoint_to_tables(model.state_dict(), str(tmp_path), {"users.": cncore.StoreConfig(dim=7)})


def test_command_line_converts_a_saved_checkpoint(tmp_path, capsys):
    from cncore_torch.checkpoint import main
    model = trained_model()
    torch.save({"model": model.state_dict(), "step": 3}, str(tmp_path / "ckpt.pt"))
    assert main(["to-tables", str(tmp_path / "ckpt.pt"), str(tmp_path / "tables"), "--entry", "model"]) == 0
    assert "wrote 2 tables" in capsys.readouterr().out
    assert open_table(str(tmp_path / "tables" / "users")).config.optimizer == cncore.RowWiseAdagrad()
    assert main(["from-tables", str(tmp_path / "tables"), str(tmp_path / "back.pt")]) == 0
    assert_state_dicts_equal(torch.load(str(tmp_path / "back.pt")), table_entries(model.state_dict()))


def crafted(prefix: str, dim: int = 2) -> dict:
    """A state_dict table group under `prefix` (as a checkpoint file may hold it)."""
    return {prefix + "keys": torch.tensor([1, 2]), prefix + "rows": torch.zeros(2, dim),
            prefix + "optimizer_state": torch.zeros(2, 0), prefix + "counts": torch.zeros(2, dtype=torch.int64),
            prefix + "last_steps": torch.zeros(2, dtype=torch.int64), prefix + "step": torch.tensor(0)}


@pytest.mark.parametrize("prefix", ["../escaped.", "../../escaped.", "ABS/path.", "a/b.", "a\\b.", "..", ".",
                                    "x\0y.", "@root."])
def test_checkpoint_keys_cannot_name_a_path(tmp_path, capsys, prefix):
    """State_dict keys like ../escaped.rows or /abs/path.rows used to write outside the output directory."""
    prefix = prefix.replace("ABS", str(tmp_path / "abs"))
    out = tmp_path / "work" / "tables"
    out.mkdir(parents=True)
    state = {**crafted("good."), **crafted(prefix)}  # a good table too: nothing at all is written
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="a table name must be one plain path component"):
        checkpoint_to_tables(state, str(out))
    assert tree(tmp_path) == before
    from cncore_torch.checkpoint import main
    torch.save(state, str(tmp_path / "ckpt.pt"))
    before = tree(tmp_path)
    assert main(["to-tables", str(tmp_path / "ckpt.pt"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("python -m cncore_torch.checkpoint to-tables: error: state_dict prefix")
    assert tree(tmp_path) == before


def test_checkpoint_shapes_are_checked_before_anything_is_written(tmp_path):
    state = {**crafted("good."), **crafted("bad.")}
    state["bad.rows"] = torch.zeros(2)  # 1-D rows used to be an IndexError
    with pytest.raises(ValueError, match=r"bad\.rows: shape \(2,\); expected 2-D"):
        checkpoint_to_tables(state, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_to_fixed_and_remap_of_empty_tables():
    """remap_to_fixed raised IndexError on a table with no rows; every ID goes to the zero row."""
    from torchrec import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from cncore_torch.collection import CNEmbeddingBagCollection
    from cncore_torch.convert import remap_to_fixed, to_fixed
    configs = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    collection = CNEmbeddingBagCollection(tables=configs, optimizer=cncore.SGD())
    fixed, id_maps = to_fixed(collection)
    assert fixed.embedding_bags["t"].weight.shape == (1, 4) and id_maps["t"].shape == (0,)
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([5, 2**40, -1]), lengths=torch.tensor([2, 1]))
    remapped = remap_to_fixed(kjt, configs, id_maps)
    assert remapped.values().tolist() == [0, 0, 0]
    assert not fixed(remapped).values().any()
