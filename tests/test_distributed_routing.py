"""Key routing (`owner_of`) and the sharder's contract, in one process (no process group)."""
import pytest
import torch

pytest.importorskip("torchrec")
from torchrec import EmbeddingBagConfig

import cncore
from cncore_torch import CNEmbeddingBagCollection
from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, owner_of, plan_for
from cncore_torch.distributed.routing import ROUTE_SALT, mix64

M = (1 << 64) - 1


def mix64_reference(k: int) -> int:
    """cn_mix64 (cython_src/include/cn_mix.h) in Python integers."""
    z = k & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


EDGE_KEYS = [0, 1, -1, 2, 2**31, 2**32 + 7, 2**62, -2**63, 2**63 - 1, 12345678901234567]


def test_mix64_is_the_cores_mixer_bit_for_bit():
    got = mix64(torch.tensor(EDGE_KEYS)).tolist()
    assert [g & M for g in got] == [mix64_reference(k) for k in EDGE_KEYS]


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_owner_is_the_high_bits_of_the_salted_mix(world_size):
    want = [(mix64_reference(k ^ ROUTE_SALT) >> 32) * world_size >> 32 for k in EDGE_KEYS]
    assert owner_of(torch.tensor(EDGE_KEYS), world_size).tolist() == want


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("keys", ["consecutive", "even", "multiples_of_world", "high_bits"])
def test_structured_keys_spread_evenly(world_size, keys):
    n = 60_000
    ids = {"consecutive": torch.arange(n), "even": torch.arange(n) * 2,
           "multiples_of_world": torch.arange(n) * world_size, "high_bits": torch.arange(n) << 40}[keys]
    counts = torch.bincount(owner_of(ids, world_size), minlength=world_size).double()
    # binomial: sd = sqrt(n p (1 - p)) ~ 120; 6 sd
    assert (counts - n / world_size).abs().max() < 6 * (n / world_size) ** 0.5  # key % W fails "even", "multiples"


@pytest.mark.parametrize("n_buckets", [16, 1 << 20, 1_428_572])
def test_a_ranks_keys_fill_the_cores_buckets_evenly(n_buckets):
    """The key index puts a key at (mix64(key ^ salt) * n) >> 64, salt = mix64(n) (cn_index.h): the
    keys one rank owns must not agree in the high bits of that hash (routing by them would leave
    half of every rank's buckets empty). The eighth of the buckets a key's home falls in is its top
    three bits."""
    ids = torch.arange(100_000)
    mine = ids[owner_of(ids, 2) == 0]
    salt = mix64(torch.tensor([n_buckets]))
    top = (mix64(mine ^ salt) >> 61) & 7
    counts = torch.bincount(top, minlength=8).double()
    assert (counts / counts.sum() - 1 / 8).abs().max() < 0.01


def configs():
    return [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=100, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=10, feature_names=["f3"])]


def test_plan_for_puts_every_table_row_wise_on_every_rank_with_our_kernel():
    model = torch.nn.Sequential(CNEmbeddingBagCollection(configs(), device="meta", optimizer=cncore.SGD(lr=0.1)))
    plan = plan_for(model, 3).plan
    assert list(plan) == ["0"]
    for name in ("a", "b"):
        ps = plan["0"][name]
        assert (ps.sharding_type, ps.compute_kernel, ps.ranks) == ("row_wise", "customized_kernel", [0, 1, 2])
    with pytest.raises(ValueError, match="no CNEmbeddingBagCollection or CNEmbeddingCollection"):
        plan_for(torch.nn.Linear(2, 2), 2)


def test_the_sharder_offers_row_wise_with_our_kernel_only():
    sharder = CNEmbeddingBagCollectionSharder()
    assert sharder.module_type is CNEmbeddingBagCollection
    assert sharder.sharding_types("cpu") == ["row_wise"]
    assert sharder.compute_kernels("row_wise", "cpu") == ["customized_kernel"]
    params = sharder.shardable_parameters(CNEmbeddingBagCollection(configs(), device="meta"))
    assert {k: tuple(v.shape) for k, v in params.items()} == {"a": (100, 4), "b": (10, 8)}
    assert all(v.is_meta for v in params.values())


def _env():
    from torchrec.distributed.types import ShardingEnv
    return ShardingEnv(world_size=1, rank=0, pg=None)


def test_the_sharded_module_refuses_other_plans_and_a_missing_optimizer():
    from torchrec.distributed.types import ParameterSharding
    sharder = CNEmbeddingBagCollectionSharder()
    model = CNEmbeddingBagCollection(configs(), device="meta", optimizer=cncore.SGD(lr=0.1))
    good = plan_for(torch.nn.Sequential(model), 1).plan["0"]
    bad = dict(good)
    bad["a"] = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0])
    with pytest.raises(ValueError, match="table 'a': planned as table_wise/fused"):
        sharder.shard(model, bad, _env())
    with pytest.raises(RuntimeError, match="optimizer=.*apply_optimizer_in_backward"):  # both ways, named
        sharder.shard(CNEmbeddingBagCollection(configs(), device="meta"), good, _env())


@pytest.mark.parametrize("make,match", [
    (lambda: "nope", "features must be a KeyedJaggedTensor"),
    (lambda: _kjt(values=torch.tensor([1.0, 2.0])), "values must be int64 or int32"),
    (lambda: _kjt(lengths=torch.tensor([1, 1, 1, -1])), "lengths must be >= 0"),
    (lambda: _kjt(lengths=torch.tensor([1, 1, 1, 1])), "lengths add up to 4, but values holds 2"),
    (lambda: _kjt(keys=["f1", "f2"]), "no key 'f3'"),
    (lambda: _kjt(values=torch.tensor([1, 2], device="meta")), "values is on meta"),
    (lambda: _kjt(weights=torch.ones(2, dtype=torch.int64)), "weights must be floating point"),
])
def test_a_bad_batch_is_refused_before_any_collective(make, match):
    from cncore_torch.distributed.embedding_sharding import check_features
    with pytest.raises((TypeError, ValueError), match=match):
        check_features(make(), ["f1", "f2", "f3"], False)
    with pytest.raises(ValueError, match="is_weighted=True but the KJT has no weights"):
        check_features(_kjt(), ["f1", "f2", "f3"], True)


def _kjt(keys=("f1", "f2", "f3"), values=None, lengths=None, weights=None):
    from torchrec import KeyedJaggedTensor
    values = torch.tensor([1, 2]) if values is None else values
    lengths = torch.tensor([1, 0, 1, 0, 0, 0][:2 * len(keys)]) if lengths is None else lengths
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights, stride=2)
