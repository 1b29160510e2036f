"""python -m cncore_torch.serving: freeze a saved model with its tables read from their chains,
apply the chains' new versions, export, inspect; bad input exits 2 with one line."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from reference import run_isolated
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import cncore
from cncore.tablefile import save_table
from cncore_torch import CNEmbeddingBagCollection
from cncore_torch.serving.cli import main

CONFIGS = [EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=10, feature_names=["user"]),
           EmbeddingBagConfig(name="t_item", embedding_dim=2, num_embeddings=10, feature_names=["item"])]


def kjt(ids):
    return KeyedJaggedTensor.from_lengths_sync(["user", "item"], torch.tensor(list(ids) * 2),
                                               torch.tensor([len(ids), len(ids)]))


def train(ebc, ids):
    ebc.train()
    ebc(kjt(ids)).values().sum().backward()
    ebc.eval()


@pytest.fixture
def trained(tmp_path, request):
    """A model file, its tables' chains (a base then one delta), the live collection, and the
    base versions; t_user with `request.param` fallback rows (default 0)."""
    ebc = CNEmbeddingBagCollection(CONFIGS, optimizer=cncore.SGD(lr=0.1),
                                   fallback_rows={"t_user": getattr(request, "param", 0)})
    train(ebc, range(20))
    model = torch.nn.Sequential(ebc)
    torch.save(model, tmp_path / "model.pt")
    saves = {n: save_table(s, tmp_path / n) for n, s in ebc.stores.items()}
    return model, saves


@pytest.mark.parametrize("trained", [0, 3], indirect=True, ids=["plain", "fallback"])
def test_freeze_then_apply_follows_the_chains(tmp_path, trained, capsys):
    """With fallback rows, the probe's unseen and erased IDs read them in both models."""
    model, saves = trained
    ebc = model[0]
    chains = [f"--chain={n}={tmp_path / n}" for n in saves]
    train(ebc, [3, 30, 31])                # after the model file was written: the chains are newer
    ebc.stores["t_user"].erase(np.array([0]))
    for n, s in ebc.stores.items():
        saves[n] = save_table(s, tmp_path / n, since=saves[n])
    assert main(["freeze", str(tmp_path / "model.pt"), "-o", str(tmp_path / "serving.pt"), *chains]) == 0
    probe = kjt(range(-3, 40))
    frozen = torch.load(tmp_path / "serving.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(frozen(probe).values(), ebc(probe).values())
    train(ebc, [5, 40, 41])
    ebc.stores["t_item"].erase(np.array([1, 2]))
    for n, s in ebc.stores.items():
        saves[n] = save_table(s, tmp_path / n, since=saves[n])
    capsys.readouterr()
    assert main(["apply", str(tmp_path / "serving.pt"), *chains]) == 0
    assert "IDs added, 2 removed" in capsys.readouterr().out
    frozen = torch.load(tmp_path / "serving.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(frozen(probe).values(), ebc(probe).values())
    assert frozen.serving_versions == {n: s.version for n, s in saves.items()}
    assert main(["inspect", str(tmp_path / "serving.pt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    weight = frozen[0].embedding_bag_collection.embedding_bags["t_user"].weight
    n, shared = len(ebc.stores["t_user"]), ebc.stores["t_user"].fallback_rows
    note = f", {shared} fallback" if shared else ""
    assert lines[1] == (f"  0.t_user: {n} IDs, dim 4, {weight.shape[0]} rows allocated (0 free{note}), "
                        f"{weight.nbytes + 16 * n} bytes, chain version {saves['t_user'].version}")

@pytest.mark.slow
def test_export_runs_without_cncore(tmp_path, trained):
    model, _ = trained
    assert main(["freeze", str(tmp_path / "model.pt"), "-o", str(tmp_path / "serving.pt")]) == 0
    torch.save((kjt([1, 2, 99]),), tmp_path / "example.pt")
    assert main(["export", str(tmp_path / "serving.pt"), "--example", str(tmp_path / "example.pt"),
                 "-o", str(tmp_path / "m.pt2")]) == 0
    with torch.no_grad():
        torch.save((kjt([5, 6, 7, 8, 500]), model(kjt([5, 6, 7, 8, 500])).values()), tmp_path / "io.pt")
    got = run_isolated(f"""
        import sys, json
        sys.modules["cncore"] = None
        sys.modules["cncore_torch"] = None
        import torch, torchrec
        features, expected = torch.load({str(tmp_path / 'io.pt')!r}, weights_only=False)
        out = torch.export.load({str(tmp_path / 'm.pt2')!r}).module()(features).values()
        print(json.dumps(bool(torch.equal(out, expected))))
    """, timeout=120)
    assert got is True
    proc = subprocess.run([sys.executable, "-m", "cncore_torch.serving", "inspect", str(tmp_path / "m.pt2")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "embedding_bags.t_user.weight: (21, 4) float32 336 bytes" in proc.stdout


def test_bad_input_exits_2_with_one_line(tmp_path, trained, capsys):
    assert main(["freeze", str(tmp_path / "missing.pt"), "-o", str(tmp_path / "s.pt")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.pt'}: no such file\n"
    assert main(["freeze", str(tmp_path / "model.pt"), "-o", str(tmp_path / "s.pt"), "--chain", "t_user"]) == 2
    assert capsys.readouterr().err == ("error: --chain 't_user': expected TABLE=DIR, e.g. "
                                       "--chain t_user=ckpt/tables/t_user\n")
    assert main(["freeze", str(tmp_path / "model.pt"), "-o", str(tmp_path / "s.pt")]) == 0
    assert main(["apply", str(tmp_path / "s.pt"), f"--chain=t_user={tmp_path / 't_user'}"]) == 2
    assert capsys.readouterr().err == ("error: --chain t_user: the serving file records no version of t_user "
                                       "(it records none); freeze it with --chain t_user=DIR first\n")
    (tmp_path / "junk.pt").write_text("not a model")
    assert main(["inspect", str(tmp_path / "junk.pt")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'junk.pt'}: not a torch.save file (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pt", "model.pt", "s.pt", "t_item", "t_user"]
