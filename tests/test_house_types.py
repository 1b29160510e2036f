"""What the typing pass states in code: the policies' module and its re-exports, the refusals
the narrowing added (by name, not an error from deep inside), and the fused optimizer's
`step` overloads returning what torch's do."""
from types import SimpleNamespace

import pytest
import torch

import cncore
import cncore.config
import cncore.policies
from cn_dlrm import bounded
from cncore.tablefile import load_store, save_table
from cncore_torch import CNEmbeddingBag

POLICY_NAMES = ("LRU", "LFU", "TTL", "MinCount", "Probability", "Eviction", "Admission")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policies_are_one_class_under_every_import(name):
    assert getattr(cncore, name, getattr(cncore.config, name)) is getattr(cncore.policies, name)
    assert getattr(cncore.config, name) is getattr(cncore.policies, name)
    assert name in cncore.config.__all__ and name in cncore.policies.__all__


def test_a_config_with_policies_round_trips_through_its_file_form(tmp_path):
    store = cncore.make_store(dim=2, max_rows=8, eviction=cncore.LFU(halve_every=4),
                              admission=cncore.MinCount(2, width=16))
    path = str(tmp_path / "t.cnt")
    save_table(store, path)
    config = load_store(path).config
    assert config.eviction == cncore.LFU(halve_every=4) and type(config.eviction) is cncore.policies.LFU
    assert config.admission == cncore.MinCount(2, width=16)


def test_ttl_policy_without_steps_is_refused_by_the_option_name():
    with pytest.raises(ValueError) as e:
        bounded.policy("ttl", None)
    assert str(e.value) == "--evict ttl needs --ttl-steps S (rows unused for more than S steps expire)"
    assert bounded.policy("ttl", 5) == cncore.TTL(5)
    assert bounded.policy("lru", None) == cncore.LRU() and bounded.policy(None, None) is None


def test_a_percentage_budget_without_the_synthetic_stream_is_refused_by_the_option_name():
    args = SimpleNamespace(max_rows="25%", steps=4)
    with pytest.raises(ValueError) as e:
        bounded.table_budgets(args, ["t_a"], None)
    assert str(e.value) == ("--max-rows 25% counts distinct IDs in the synthetic stream; with --criteo-tsv give "
                            "rows per table (--max-rows N)")
    assert bounded.table_budgets(SimpleNamespace(max_rows="7", steps=4), ["t_a", "t_b"], None) == {"t_a": 7, "t_b": 7}


def test_fused_optimizer_step_returns_the_closures_loss_as_torch_optimizers_do():
    opt = CNEmbeddingBag(4, 2, optimizer=cncore.SGD(lr=0.1)).fused_optimizer
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert opt.step() is None and reference.step() is None
    assert opt.step(lambda: 2.5) == 2.5 == reference.step(lambda: 2.5)
