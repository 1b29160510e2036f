"""The sharded pooled collection at TorchRec's seams, over 2 gloo processes: per-sample weights
that require grad get their gradient back across ranks.

Each rank builds the same two weighted KJTs (batch sizes 3 and 2, keys in another order than the
tables', IDs owned by both ranks), feeds its own to DMP with our sharder and, as references, runs
on their concatenation (rank order): the unsharded CNEmbeddingBagCollection (same configs, seed
and optimizer) and TorchRec's EmbeddingBagCollection holding the same rows (the SUM table;
TorchRec's weighted EBC pools by SUM only). Loss = sum(out * fixed targets), so every pooled
row's gradient is the same in all three. Checked on every rank: its weights' gradient equals the
references' gradient of the same weights (a mean table's included), and the rows it owns equal
the unsharded collection's after each step and TorchRec's rows minus their gradient (SGD lr=1).
"""
import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

TIMEOUT = 90.0
ROWS = 40
BATCHES = [3, 2]
KEYS = ["f3", "f1", "f2"]  # not the tables' order: the input dist permutes


def _configs():
    from torchrec import EmbeddingBagConfig, PoolingType
    return [EmbeddingBagConfig(name="t_shared", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t_mean", embedding_dim=3, num_embeddings=ROWS, feature_names=["f3"],
                               pooling=PoolingType.MEAN)]


def _kjts(seed, high):
    """One weighted KJT per rank (bags of 0..4 IDs in [0, high)), and the same weights as leaves."""
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(seed)
    out = []
    for b in BATCHES:
        lengths = rng.integers(0, 5, len(KEYS) * b)
        values = rng.integers(0, high, int(lengths.sum()))
        weights = torch.from_numpy(rng.random(len(values)).astype(np.float32) + 0.5).requires_grad_()
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=torch.from_numpy(values),
                                                       lengths=torch.from_numpy(lengths), weights=weights))
    return out


def _concat(kjts, weights):
    """Every rank's bags of each key in rank order, weighted by `weights` (one tensor per rank,
    concatenated on the graph)."""
    from torchrec import KeyedJaggedTensor
    values, lengths, parts = [], [], []
    for key in KEYS:
        for r, k in enumerate(kjts):
            offsets = k.offset_per_key()
            i = KEYS.index(key)
            values.append(k[key].values()), lengths.append(k[key].lengths())
            parts.append(weights[r][offsets[i]:offsets[i + 1]])
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=torch.cat(values), lengths=torch.cat(lengths),
                                               weights=torch.cat(parts))


def _weights_grads_and_rows(rank, world_size):
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, owner_of

    make = lambda device: CNEmbeddingBagCollection(_configs(), is_weighted=True, device=device,  # noqa: E731
                                                   optimizer=cncore.SGD(lr=1.0), seed=7, per_rank_tables=True)
    dmp = DistributedModelParallel(make("meta"), device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder()])
    sharded, ref = dmp.module, make("cpu")
    torchrec_ebc = EmbeddingBagCollection(_configs()[:1], is_weighted=True)
    with torch.no_grad():  # TorchRec's table holds our initial rows of IDs 0..ROWS-1
        rows = make("cpu").stores["t_shared"].lookup(np.arange(ROWS), insert_missing=True)
        torchrec_ebc.embedding_bags["t_shared"].weight.copy_(torch.from_numpy(rows))
    start = sum(BATCHES[:rank])
    for step, high in enumerate([ROWS, 2**62]):
        kjts = _kjts(10 + step, high)
        targets = torch.from_numpy(np.random.default_rng(step).standard_normal((sum(BATCHES), 11)).astype(np.float32))
        out = dmp(kjts[rank])
        (out.values() * targets[start:start + BATCHES[rank]]).sum().backward()
        ref_weights = [k.weights().detach().clone().requires_grad_() for k in kjts]
        full = _concat(kjts, ref_weights)
        (ref(full).values() * targets).sum().backward()
        mine = kjts[rank].weights().grad
        assert mine is not None and mine.shape == kjts[rank].weights().shape
        torch.testing.assert_close(mine, ref_weights[rank].grad, rtol=1e-5, atol=1e-6)
        if high == ROWS:  # TorchRec's EBC on the same rows: its gradient of the f1, f2 weights, its rows moved
            tr_weights = [k.weights().detach().clone().requires_grad_() for k in kjts]
            tr_full = _concat(kjts, tr_weights)
            tr_out = torchrec_ebc(tr_full)
            assert tr_out.keys() == ["f1", "f2"]
            (tr_out.values() * targets[:, :8]).sum().backward()
            f12 = slice(kjts[rank].offset_per_key()[1], None)
            torch.testing.assert_close(mine[f12], tr_weights[rank].grad[f12], rtol=1e-5, atol=1e-6)
            table = torchrec_ebc.embedding_bags["t_shared"].weight
            expected = (table - table.grad).detach()
            batch = sharded.stores["t_shared"].export()
            torch.testing.assert_close(torch.from_numpy(batch.rows), expected[torch.from_numpy(batch.keys)],
                                       rtol=1e-5, atol=1e-6)
        for name, store in sharded.stores.items():
            batch = store.export()
            assert len(batch.keys) and (owner_of(torch.from_numpy(batch.keys), world_size) == rank).all()
            torch.testing.assert_close(torch.from_numpy(batch.rows), torch.from_numpy(ref.stores[name].lookup(
                batch.keys)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_weights_gradient_equals_unsharded_and_torchrec():
    from cncore_torch.distributed.launch import spawn
    spawn(_weights_grads_and_rows, 2, timeout=TIMEOUT)


def _position_weighted(ebc):
    from torchrec.modules.feature_processor_ import PositionWeightedModule
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    module = FeatureProcessedEmbeddingBagCollection(ebc, {f: PositionWeightedModule(4) for f in ("f1", "f2")})
    with torch.no_grad():
        for i, p in enumerate(module._feature_processors.parameters()):
            p.copy_(torch.linspace(0.5, 2.0, p.numel()) + i)
    return module


def _position_weights_learn(rank, world_size):
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder

    make = lambda device: CNEmbeddingBagCollection(_configs()[:1], is_weighted=True, device=device,  # noqa: E731
                                                   optimizer=cncore.SGD(lr=1.0), seed=7, per_rank_tables=True)
    dmp = DistributedModelParallel(_position_weighted(make("meta")), device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder()])
    ebc = EmbeddingBagCollection(_configs()[:1], is_weighted=True)
    with torch.no_grad():
        rows = make("cpu").stores["t_shared"].lookup(np.arange(ROWS), insert_missing=True)
        ebc.embedding_bags["t_shared"].weight.copy_(torch.from_numpy(rows))
    ref = _position_weighted(ebc)
    rng = np.random.default_rng(5)
    lengths = [torch.from_numpy(rng.integers(0, 5, 2 * b)) for b in BATCHES]
    values = [torch.from_numpy(rng.integers(0, ROWS, int(n.sum()))) for n in lengths]
    kjts = [KeyedJaggedTensor.from_lengths_sync(["f2", "f1"], v, n) for v, n in zip(values, lengths)]
    full = KeyedJaggedTensor.from_lengths_sync(["f2", "f1"], *(torch.cat(t) for t in zip(*[
        (k[f].values(), k[f].lengths()) for f in ("f2", "f1") for k in kjts])))
    targets = torch.from_numpy(np.random.default_rng(6).standard_normal((sum(BATCHES), 8)).astype(np.float32))
    start = sum(BATCHES[:rank])
    out = dmp(kjts[rank])
    out = out.wait() if hasattr(out, "wait") else out
    (out.values() * targets[start:start + BATCHES[rank]]).sum().backward()
    expected = ref(full)
    torch.testing.assert_close(out.values(), expected.values()[start:start + BATCHES[rank]], rtol=1e-5, atol=1e-6)
    mine = torch.zeros(sum(BATCHES), 1)
    mine[start:start + BATCHES[rank]] = 1
    (expected.values() * targets * mine).sum().backward(retain_graph=True)  # the reference's part of my samples
    own = {name: q.grad.clone() for name, q in ref._feature_processors.named_parameters()}
    (expected.values() * targets * (1 - mine)).sum().backward()             # the rest: the whole batch's for rows
    ours = dict(dmp.named_parameters())
    for name in own:
        p = ours[f"_feature_processors.{name}"]
        assert bool((own[name] != 0).any())
        # the dense gradient of this rank's own samples, as TorchRec's sharded FPEBC leaves it (no average)
        torch.testing.assert_close(p.grad, own[name], rtol=1e-5, atol=1e-6)
    table = ebc.embedding_bags["t_shared"].weight
    batch = next(m for m in dmp.modules() if hasattr(m, "stores")).stores["t_shared"].export()
    torch.testing.assert_close(torch.from_numpy(batch.rows), (table - table.grad).detach()[torch.from_numpy(
        batch.keys)], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_position_weights_learn_as_torchrecs():
    """DMP with our sharder over FeatureProcessedEmbeddingBagCollection + PositionWeightedModule:
    each rank's position weights get TorchRec's gradient of that rank's samples (as TorchRec's own
    sharded FPEBC leaves them), and the rows move by the whole batch's gradient as TorchRec's."""
    from cncore_torch.distributed.launch import spawn
    spawn(_position_weights_learn, 2, timeout=TIMEOUT)


STRIDES = [[2, 3, 1], [1, 2, 2]]  # each rank's batch size per key (KEYS), expanded to 4 and 3 samples
SAMPLES = [4, 3]


def _variable_batch_kjts(seed):
    """One weighted KJT per rank with a batch size per key and its inverse_indices; and the same
    batch as an ordinary KJT, built here bag by bag, whose weights are the VBE weights' entries."""
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(seed)
    vbe, plain = [], []
    for strides, samples in zip(STRIDES, SAMPLES):
        lengths = rng.integers(0, 4, sum(strides))
        values = rng.integers(0, ROWS, int(lengths.sum()))
        weights = torch.from_numpy(rng.random(len(values)).astype(np.float32) + 0.5).requires_grad_()
        inverse = torch.stack([torch.from_numpy(rng.integers(0, s, samples)) for s in strides])
        vbe.append(KeyedJaggedTensor(keys=KEYS, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths),
                                     weights=weights, stride_per_key_per_rank=[[s] for s in strides],
                                     inverse_indices=(KEYS, inverse)))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        first_bag = np.concatenate([[0], np.cumsum(strides)])
        positions, new_lengths = [], []
        for k in range(len(KEYS)):
            for b in range(samples):
                bag = first_bag[k] + int(inverse[k, b])
                positions.extend(range(starts[bag], starts[bag + 1]))
                new_lengths.append(lengths[bag])
        plain.append((torch.tensor(values[positions]), torch.tensor(new_lengths), torch.tensor(positions,
                                                                                              dtype=torch.int64)))
    return vbe, plain


def _concat_plain(plain, weights):
    """The ordinary KJTs of every rank, each key's bags in rank order, weighted by `weights` (one
    leaf per rank) on the graph."""
    from torchrec import KeyedJaggedTensor
    values, lengths, parts = [], [], []
    for k in range(len(KEYS)):
        for (v, n, pos), w, samples in zip(plain, weights, SAMPLES):
            bags = n.view(len(KEYS), samples)
            start, stop = int(bags[:k].sum()), int(bags[:k + 1].sum())
            values.append(v[start:stop]), lengths.append(bags[k]), parts.append(w[pos[start:stop]])
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=torch.cat(values), lengths=torch.cat(lengths),
                                               weights=torch.cat(parts))


def _variable_batch(rank, world_size):
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder

    make = lambda device: CNEmbeddingBagCollection(_configs(), is_weighted=True, device=device,  # noqa: E731
                                                   optimizer=cncore.Adagrad(lr=0.1), seed=7, per_rank_tables=True)
    dmp = DistributedModelParallel(make("meta"), device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder()])
    sharded, ref = dmp.module, make("cpu")
    torchrec_ebc = EmbeddingBagCollection(_configs()[:1], is_weighted=True)
    with torch.no_grad():
        rows = make("cpu").stores["t_shared"].lookup(np.arange(ROWS), insert_missing=True)
        torchrec_ebc.embedding_bags["t_shared"].weight.copy_(torch.from_numpy(rows))
    start = sum(SAMPLES[:rank])
    for step in range(2):
        vbe, plain = _variable_batch_kjts(20 + step)
        targets = torch.from_numpy(np.random.default_rng(step).standard_normal((sum(SAMPLES), 11)).astype(np.float32))
        out = dmp(vbe[rank])
        ref_weights = [k.weights().detach().clone().requires_grad_() for k in vbe]
        expected = ref(_concat_plain(plain, ref_weights))
        assert out.values().shape == (SAMPLES[rank], 11)
        torch.testing.assert_close(out.values(), expected.values()[start:start + SAMPLES[rank]], rtol=1e-5, atol=1e-6)
        if step == 0:  # TorchRec's EBC expands the same VBE KJT to the same rows
            torch.testing.assert_close(out.values()[:, :8], torchrec_ebc(vbe[rank]).values(), rtol=1e-5, atol=1e-6)
        (out.values() * targets[start:start + SAMPLES[rank]]).sum().backward()
        (expected.values() * targets).sum().backward()
        torch.testing.assert_close(vbe[rank].weights().grad, ref_weights[rank].grad, rtol=1e-5, atol=1e-6)
        for name, store in sharded.stores.items():
            batch = store.export()
            torch.testing.assert_close(torch.from_numpy(batch.rows), torch.from_numpy(ref.stores[name].lookup(
                batch.keys)), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.from_numpy(batch.optimizer_state), torch.from_numpy(
                ref.stores[name].read(batch.keys).optimizer_state), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_variable_batch_per_key_equals_its_expansion_and_torchrec():
    """KJTs with a batch size per key (stride_per_key_per_rank, inverse_indices), a different one
    per rank: each rank's output equals TorchRec's EBC's expansion of it and the unsharded
    collection's output on the expanded batch; the weights' gradient (samples sharing a bag add
    up) and the rows and Adagrad state after each step equal the unsharded collection's on the
    expanded batches of both ranks."""
    from cncore_torch.distributed.launch import spawn
    spawn(_variable_batch, 2, timeout=TIMEOUT)


@pytest.mark.slow
def test_variable_batch_without_inverse_indices_is_refused_by_name():
    """The sharded collection pools every feature into rows of one batch and needs the KJT's
    inverse_indices, as TorchRec's EBC does: refused at the first forward, nothing inserted (one
    gloo rank, in a child)."""
    from reference import run_isolated
    result = run_isolated("""
        import json, socket, torch, cncore
        import torch.distributed as dist
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.distributed.types import ShardingEnv
        from cncore_torch import CNEmbeddingBagCollection
        from cncore_torch.distributed import ShardedCNEmbeddingBagCollection, plan_for
        model = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10,
                                                             feature_names=["a", "b"])], device="meta",
                                         optimizer=cncore.SGD(lr=0.1))
        sharded = ShardedCNEmbeddingBagCollection(model, plan_for(model, 1).plan[""],
                                                  ShardingEnv.from_process_group(dist.group.WORLD), None)
        kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
                                stride_per_key_per_rank=[[1], [2]])
        try:
            sharded(kjt)
            error = None
        except ValueError as exc:
            error = str(exc)
        print(json.dumps({"error": error, "rows": len(sharded.stores["t"])}))
    """, timeout=120)
    assert result["error"] == (
        "features: the KJT has a batch size per key (stride_per_key_per_rank=[[1], [2]]) but no inverse_indices; "
        "ShardedCNEmbeddingBagCollection pools every feature into rows of one batch, as TorchRec's "
        "EmbeddingBagCollection does, and needs them: build the KJT with inverse_indices=(keys, (len(keys), batch "
        "size) int tensor)")
    assert result["rows"] == 0
