"""The public-API check CI runs (.ci/check_api.py): annotations and TorchRec-form docstrings."""
import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_api", ROOT / ".ci" / "check_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented(keys: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Scaled keys.

    Args:
        keys (np.ndarray): the keys.
        scale (float): the factor.

    Returns:
        np.ndarray: keys * scale.
    """
    return keys * scale


def unannotated(keys, scale: float = 1.0) -> np.ndarray:
    """Scaled keys.

    Args:
        keys: the keys.
        scale (float): the factor.

    Returns:
        np.ndarray: keys * scale.
    """
    return keys * scale


def no_sections(keys: np.ndarray) -> np.ndarray:
    """Scaled keys."""
    return keys


def no_returns(keys: np.ndarray) -> np.ndarray:
    """Scaled keys.

    Args:
        keys (np.ndarray): the keys.
    """
    return keys


def returns_nothing(keys: np.ndarray) -> None:
    """Nothing back.

    Args:
        keys (np.ndarray): the keys.
    """


def test_a_function_with_annotations_args_and_returns_has_no_gap(check):
    assert check._gaps_of(documented, "function") == []
    assert check._gaps_of(returns_nothing, "function") == []


@pytest.mark.parametrize("function, gaps", [
    (unannotated, ["annotations"]),
    (no_sections, ["Args", "Returns"]),
    (no_returns, ["Returns"]),
])
def test_each_missing_piece_is_named(check, function, gaps):
    assert check._gaps_of(function, "function") == gaps


class Store:
    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As EmbeddingStore.find, on disk too."""
        raise NotImplementedError

    def erase(self, keys: np.ndarray, strict: bool) -> np.ndarray:
        """As EmbeddingStore.erase."""
        raise NotImplementedError


def test_a_method_documented_as_another_with_the_same_parameters_takes_its_args_and_returns(check):
    import cncore  # noqa: F401  (the reference resolves from the loaded package)

    assert check._gaps_of(Store.find, "method") == []
    # Another parameter list: EmbeddingStore.erase's Args do not document `strict`.
    assert check._gaps_of(Store.erase, "method") == ["Args", "Returns"]


def test_the_tree_lists_every_gap_it_has(check, capsys):
    assert check.main() == 0, capsys.readouterr().out
