"""TorchRec's inference quantizers on frozen models: int8 / fp16 rows the TorchRec way (the
collection inside swapped for TorchRec's quantized one), outputs within the stated rounding
bound of the float32 frozen model, unseen IDs still exact zeros; live models are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.inference.modules import quantize_embeddings, quantize_inference_model
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

import cncore
from cncore_torch import CNEmbeddingBag, CNEmbeddingBagCollection, CNEmbeddingCollection
from cncore_torch.serving import freeze
from cncore_torch.serving.quantize import row_error_bound

FEATURES = ["f", "g"]


def trained(pooling, weighted):
    ebc = CNEmbeddingBagCollection(
        [EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=10, feature_names=["f"], pooling=pooling),
         EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["g"], pooling=pooling)],
        is_weighted=weighted, optimizer=cncore.SGD(lr=0.5))
    for step in range(3):
        ebc(kjt(np.random.default_rng(step), 30, weighted)).values().sum().backward()
    return ebc.eval()


def kjt(rng, high, weighted):
    lengths = rng.integers(0, 6, 2 * 5)
    ids = rng.integers(0, high, int(lengths.sum()))
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.from_numpy(ids), torch.from_numpy(lengths),
                                               weights=torch.rand(int(lengths.sum())) * 2 - 1 if weighted else None)


def pooled_bound(ebc, features, dtype) -> np.ndarray:
    """Per bag: sum of |weight| * the row's bound (row_error_bound of each trained row, 0 for an
    unseen ID), times 1/length for mean, plus float32 rounding of the sum; (B, sum of dims)."""
    out = []
    for config in ebc.embedding_bag_configs():
        e = ebc.stores[config.name].export()
        bound = dict(zip(e.keys.tolist(), row_error_bound(torch.from_numpy(e.rows), dtype).tolist()))
        size = dict(zip(e.keys.tolist(), np.abs(e.rows).max(axis=1).tolist()))
        jt = features.to_dict()[config.feature_names[0]]
        ids, offsets = jt.values().tolist(), jt.offsets().tolist()
        w = jt.weights().abs().tolist() if ebc.is_weighted() else [1.0] * len(ids)
        col = []
        for b in range(len(offsets) - 1):
            span = range(offsets[b], offsets[b + 1])
            total = sum(w[i] * bound.get(ids[i], 0.0) for i in span)
            total += 2.0**-22 * sum(w[i] * size.get(ids[i], 0.0) for i in span)  # float32 sums, either side
            if config.pooling == PoolingType.MEAN and len(span):
                total /= len(span)
            col.append(total)
        out.append(np.repeat(np.array(col)[:, None], config.embedding_dim, axis=1))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
@pytest.mark.parametrize(("pooling", "weighted"), [(PoolingType.SUM, False), (PoolingType.MEAN, True)])
def test_quantize_embeddings_on_a_frozen_model_stays_within_the_bound(pooling, weighted, dtype):
    ebc = trained(pooling, weighted)
    frozen = freeze(torch.nn.Sequential(ebc))
    quantized = quantize_embeddings(frozen, dtype=dtype, inplace=False)
    inner = quantized[0].embedding_bag_collection
    assert isinstance(inner, QuantEmbeddingBagCollection)
    assert {t.dtype for t in inner.state_dict().values()} == {torch.uint8}   # rows (and scale, bias) as bytes
    assert frozen[0].embedding_bag_collection.embedding_bags["a"].weight.dtype == torch.float32  # a copy
    features = kjt(np.random.default_rng(9), 45, weighted)   # IDs 30..44 were never trained: zeros
    exact, got = frozen(features).values().numpy(), quantized(features).values().numpy()
    error = np.abs(got - exact)
    assert (error <= pooled_bound(ebc, features, dtype)).all()
    assert error.max() > 0   # the rows were rounded
    unseen = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.tensor([40, 41, 42]), torch.tensor([2, 0, 1, 0]),
                                                 weights=torch.ones(3) if weighted else None)
    assert torch.equal(quantized(unseen).values(), torch.zeros(2, 12))


def test_quantize_inference_model_quantizes_both_frozen_collections():
    ebc = trained(PoolingType.SUM, False)
    ec = CNEmbeddingCollection([EmbeddingConfig(name="c", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
                               optimizer=cncore.SGD(lr=0.5))
    ec(kjt(np.random.default_rng(0), 30, False))["f"].values().sum().backward()
    frozen = freeze(torch.nn.ModuleDict({"pooled": ebc, "unpooled": ec.eval()}))
    features = kjt(np.random.default_rng(10), 40, False)
    exact = frozen["unpooled"](features)["f"].values()
    quantized = quantize_inference_model(frozen)
    assert isinstance(quantized["pooled"].embedding_bag_collection, QuantEmbeddingBagCollection)
    assert isinstance(quantized["unpooled"].embedding_collection, QuantEmbeddingCollection)
    e = ec.stores["c"].export()
    bound = dict(zip(e.keys.tolist(), row_error_bound(torch.from_numpy(e.rows), torch.qint8).tolist()))
    limit = torch.tensor([bound.get(int(i), 0.0) for i in features.to_dict()["f"].values()]).unsqueeze(1)
    got = quantized["unpooled"](features)["f"].values()
    assert ((got - exact).abs() <= limit).all()


@pytest.mark.parametrize("call", ["quantize_embeddings", "quantize_inference_model"])
def test_torchrec_quantizers_refuse_a_live_model(call):
    ebc = trained(PoolingType.SUM, False)
    rows = ebc.stores["a"].export().rows.copy()
    model = torch.nn.Sequential(ebc, torch.nn.Linear(2, 2))
    quantize = {"quantize_embeddings": lambda m: quantize_embeddings(m, dtype=torch.qint8, inplace=True),
                "quantize_inference_model": quantize_inference_model}[call]
    with pytest.raises(TypeError) as info:
        quantize(model)
    assert str(info.value) == (
        f"torchrec.inference.modules.{call}: CNEmbeddingBagCollection holds dynamic tables, which TorchRec's "
        "quantizer cannot read (it would return them unquantized); freeze the model first, "
        "cncore_torch.serving.freeze(model), and quantize the frozen copy (docs/serving.md)")
    assert model[0] is ebc and np.array_equal(ebc.stores["a"].export().rows, rows)


def test_other_torch_ao_quantization_still_passes_a_live_model():
    """quantize_dynamic of the dense layers alone leaves the tables live and working."""
    bag = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.1))
    model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(bag, torch.nn.Linear(2, 2)), {torch.nn.Linear},
                                                   inplace=True)
    assert model[0] is bag and type(model[1]).__module__.startswith("torch.ao.nn.quantized")
    assert model(torch.tensor([[1, 2]])).shape == (1, 2)


@pytest.mark.parametrize("row_dtype", ["float32", "float16"])
@pytest.mark.parametrize(("pooling", "weighted"), [(PoolingType.SUM, False), (PoolingType.SUM, True),
                                                   (PoolingType.MEAN, True)])
def test_float32_rows_in_fbgemms_inference_tbe_give_the_frozen_outputs_bit_for_bit(pooling, weighted, row_dtype):
    """`quantize_embeddings(frozen, dtype=torch.float32)`: the frozen float32 rows in QuantEBC's
    kernel (FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen, SparseType.FP32), the outputs of
    TorchRec's float32 EBC exactly (docs/serving.md: float32 rows in the inference TBE)."""
    ebc = CNEmbeddingBagCollection(
        [EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=10, feature_names=["f"], pooling=pooling),
         EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["g"], pooling=pooling)],
        is_weighted=weighted, optimizer=cncore.SGD(lr=0.5), row_dtype=row_dtype)
    for step in range(3):
        ebc(kjt(np.random.default_rng(step), 30, weighted)).values().sum().backward()
    frozen = freeze(torch.nn.Sequential(ebc.eval()))
    tbe = quantize_embeddings(frozen, dtype=torch.float32, inplace=False)
    assert isinstance(tbe[0].embedding_bag_collection, QuantEmbeddingBagCollection)
    for seed in (11, 12):
        features = kjt(np.random.default_rng(seed), 45, weighted)   # IDs 30..44 unseen
        with torch.no_grad():
            assert torch.equal(tbe(features).values(), frozen(features).values())
            assert torch.equal(frozen(features).values(), ebc(features).values())

