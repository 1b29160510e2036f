"""The `cncore::` operators are registered when the first module is built, not when
cncore_torch is imported (cncore_torch.ops, "Registration"); each fresh process checks it."""
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def registered_ops_snippet(after: str) -> str:
    return f"""
        import torch
        import cncore_torch
        from cncore_torch import ops
        def registered():
            return [name for name in ("lookup", "weights_grad", "apply_gradients", "collection_pooled_lookup",
                                      "collection_pooled_backward", "collection_unpooled_lookup",
                                      "collection_unpooled_apply_gradients")
                    if torch._C._dispatch_has_kernel(f"cncore::{{name}}")]
        print(registered())
        {after}
        print(registered())
    """


def test_importing_cncore_torch_registers_no_operator_and_building_a_module_registers_all_seven():
    out = run(registered_ops_snippet("cncore_torch.CNEmbedding(10, 2)"))
    assert out.splitlines() == ["[]", "['lookup', 'weights_grad', 'apply_gradients', 'collection_pooled_lookup', "
                                      "'collection_pooled_backward', 'collection_unpooled_lookup', "
                                      "'collection_unpooled_apply_gradients']"]


def test_an_unpickled_module_registers_the_operators_in_a_fresh_process(tmp_path):
    path = tmp_path / "bag.pt"
    run(f"""
        import torch, cncore, cncore_torch
        bag = cncore_torch.CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.5),
                                          initializer=cncore.Constant(1.0))
        bag(torch.tensor([[3, 4]]))
        torch.save(bag, {str(path)!r})
    """)
    out = run(registered_ops_snippet(f"""bag = torch.load({str(path)!r}, weights_only=False)
        out = torch.ops.cncore.lookup(bag._anchor, bag._handle, [torch.tensor([3, 4])], [torch.tensor([0, 2])],
                                      [None], [0], False)[0]
        print(out.tolist())"""))
    lines = out.splitlines()
    assert lines[0] == "[]"
    assert lines[1] == "[[2.0, 2.0]]"
    assert "'lookup'" in lines[2] and "'collection_unpooled_apply_gradients'" in lines[2]
