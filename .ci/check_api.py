"""The public API's signatures and docstrings, in TorchRec's form: every public function and
method (the names in a package's `__all__`, and the public methods and properties those classes
define) has annotated parameters and return, and a docstring with an ``Args:`` section for its
parameters (a class documents its constructor's in the class docstring) and a ``Returns:``
section where it returns something. A method whose docstring begins "As `EmbeddingStore.find`"
and takes the same parameters is documented by that one (the tier's verbs are the store's).

Names that still lack them are listed in `.ci/api_gaps.txt` (one `module.name: what` a line),
as mypy's exclude list does for files: the check fails on a gap not listed, and on a listed
name that no longer has its gap, so the list only shrinks. `python .ci/check_api.py --write`
rewrites the list from the tree.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys

PACKAGES = ["cncore", "cncore.tablefile", "cncore.tier", "cncore_numpy", "cncore_torch",
            "cncore_torch.distributed", "cncore_torch.serving", "cncore_jax"]
GAPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api_gaps.txt")
OURS = ("cncore", "cncore_numpy", "cncore_torch", "cncore_jax", "cn_dlrm")


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in OURS


def _callables(package: str):
    """(qualified name, object, kind) of the package's public API."""
    module = importlib.import_module(package)
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name)
        if not _ours(obj):
            continue
        if inspect.isclass(obj):
            yield f"{package}.{name}", obj, "class"
            for attr, value in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(value, property):
                    if value.fget is not None:
                        yield f"{package}.{name}.{attr}", value.fget, "property"
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if inspect.isfunction(value):
                    yield f"{package}.{name}.{attr}", value, "method"
        elif inspect.isfunction(obj):
            yield f"{package}.{name}", obj, "function"


def _params(sig: inspect.Signature) -> list[inspect.Parameter]:
    return [p for p in list(sig.parameters.values()) if p.name not in ("self", "cls")]


_AS = re.compile(r"^As `?([A-Za-z_][\w.]*)`?")


def _documented_by(obj, doc: str):
    """The callable a docstring that starts "As `Other.name`" defers to, where it takes the same
    parameters (its Args and Returns then document this one too, as Sphinx inherits them)."""
    match = _AS.match(doc)
    if not match:
        return None
    target = sys.modules.get("cncore")
    parts = match.group(1).rstrip(".").split(".")
    for part in parts[1:] if parts[0] == "cncore" else parts:
        target = getattr(target, part, None)
    if not callable(target) or [p.name for p in _params(inspect.signature(target))] != \
            [p.name for p in _params(inspect.signature(obj))]:
        return None
    return target


def _gaps_of(obj, kind: str) -> list[str]:
    gaps: list[str] = []
    doc = inspect.getdoc(obj) or ""
    other = _documented_by(obj, doc) if kind == "method" else None
    if other is not None:
        doc = inspect.getdoc(other) or ""
    if kind == "class":
        init = obj.__init__
        if not inspect.isfunction(init) or (not _ours(init) and not dataclasses.is_dataclass(obj)):
            return gaps
        sig = inspect.signature(init)
        params = _params(sig)
        if any(p.annotation is inspect.Parameter.empty for p in params):
            gaps.append("annotations")
        if params and "Args:" not in doc:
            gaps.append("Args")
        return gaps
    sig = inspect.signature(obj)
    params = _params(sig)
    if any(p.annotation is inspect.Parameter.empty for p in params) or \
            sig.return_annotation is inspect.Signature.empty:
        gaps.append("annotations")
    if kind != "property":
        if params and "Args:" not in doc:
            gaps.append("Args")
        returns = sig.return_annotation
        if returns not in (None, "None", inspect.Signature.empty) and "Returns:" not in doc \
                and "Yields:" not in doc:
            gaps.append("Returns")
    return gaps


def current_gaps() -> dict[str, str]:
    out: dict[str, str] = {}
    for package in PACKAGES:
        for name, obj, kind in _callables(package):
            gaps = _gaps_of(obj, kind)
            if gaps:
                out.setdefault(name, ", ".join(gaps))
    return out


def main() -> int:
    gaps = current_gaps()
    if "--write" in sys.argv[1:]:
        with open(GAPS, "w") as fh:
            fh.write("# Public names without full annotations or Args/Returns (.ci/check_api.py); shrink it.\n")
            fh.writelines(f"{name}: {what}\n" for name, what in sorted(gaps.items()))
        print(f"{len(gaps)} names written to {GAPS}")
        return 0
    listed = {}
    with open(GAPS) as fh:
        for line in fh:
            if line.strip() and not line.startswith("#"):
                name, _, what = line.partition(":")
                listed[name.strip()] = what.strip()
    def parts(what: str) -> set[str]:
        return {w for w in what.split(", ") if w}

    new = {n: ", ".join(sorted(parts(w) - parts(listed.get(n, "")))) for n, w in gaps.items()
           if parts(w) - parts(listed.get(n, ""))}
    mended = sorted(n for n, w in listed.items() if parts(w) - parts(gaps.get(n, "")))
    for name, what in sorted(new.items()):
        print(f"{name}: public API without {what}: annotate it and give its docstring Args/Returns")
    for name in mended:
        print(f"{name}: no longer lacks '{listed[name]}' (now: '{gaps.get(name, 'nothing')}'): "
              f"update .ci/api_gaps.txt (python .ci/check_api.py --write)")
    print(f"public API: {len(gaps)} names with gaps listed, {len(new)} new, {len(mended)} mended")
    return 1 if new or mended else 0


if __name__ == "__main__":
    sys.exit(main())
