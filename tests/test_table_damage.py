"""Every lie a table directory can tell is refused, and refused the same way.

The catalogue below is generated: for each field of the manifest (walked from the manifest a
save writes), a list of lies of its kind (wrong types, out-of-range values, deletion), plus
lies that keep the manifest self-consistent (the checksums resealed) so that only the
cross-checks can catch them, plus damage to every array file (truncated, extended, flipped
bytes, missing, Fortran order, dtype / shape / byte order lies in the .npy header), to the
manifest and its checksum file, and to CURRENT. Each damaged table must be refused

- by `open_table`, with `TableFormatError` whose message names the table and the file or
  field at fault;
- by `cn-table inspect` and `cn-table export`, with exit status 2, one line on stderr
  (``cn-table CMD: error: ...``) and no traceback;

and nothing may change, inside the table or outside it (no export file, no temporaries).
"""
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import cncore
from cncore.tablefile import ARRAYS, config_to_dict
from cncore_numpy import TableFormatError, TableWriter, open_table
from cncore_numpy.cli import main as cn_table

CONFIG = cncore.StoreConfig(dim=3, initializer=cncore.TruncatedNormal(0.0, 1.0, -1.0, 1.0), seed=11,
                            optimizer=cncore.Adam(lr=0.01, betas=(0.8, 0.9)))
N = 6
KEYS = np.array([-(2**63), -1, 0, 1, 2**40, 2**63 - 1], np.int64)


# --- the damage tools: each edits one thing, and reseals the checksums when asked ---------

def version_dir(table: str) -> str:
    return os.path.join(table, open(os.path.join(table, "CURRENT")).read().strip())


def manifest(table: str) -> dict:
    with open(os.path.join(version_dir(table), "manifest.json")) as fh:
        return json.load(fh)


def write_manifest(table: str, m, reseal: bool = True, text: bytes | None = None) -> None:
    """Write `m` (or raw `text`) as the manifest; with `reseal`, manifest.sha256 matches it."""
    text = json.dumps(m, indent=1).encode() if text is None else text
    with open(os.path.join(version_dir(table), "manifest.json"), "wb") as fh:
        fh.write(text)
    if reseal:
        with open(os.path.join(version_dir(table), "manifest.sha256"), "w") as fh:
            fh.write(f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")


def reseal_array(table: str, name: str) -> None:
    """Make the manifest's bytes and sha256 of `name` match the file as it now is."""
    m = manifest(table)
    data = open(os.path.join(version_dir(table), f"{name}.npy"), "rb").read()
    m["arrays"][name].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_manifest(table, m)


def write_npy(table: str, name: str, arr: np.ndarray, fortran: bool = False, reseal: bool = True) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(arr.dtype),
                                               "fortran_order": fortran, "shape": arr.shape})
    buf.write((np.asfortranarray(arr) if fortran else np.ascontiguousarray(arr)).tobytes(order="A"))
    with open(os.path.join(version_dir(table), f"{name}.npy"), "wb") as fh:
        fh.write(buf.getvalue())
    if reseal:
        reseal_array(table, name)


def array(table: str, name: str) -> np.ndarray:
    return np.load(os.path.join(version_dir(table), f"{name}.npy"))


def edit_bytes(table: str, name: str, how: str, reseal: bool) -> None:
    path = os.path.join(version_dir(table), name)
    data = bytearray(open(path, "rb").read())
    if how == "truncate-1":
        data = data[:-1]
    elif how == "header-only":
        data = data[:128]
    elif how == "empty":
        data = bytearray()
    elif how == "extend":
        data += b"\0"
    elif how == "flip-last":
        data[-1] ^= 0x40
    elif how == "flip-header":
        data[20] ^= 0x01  # inside the header's dict text
    elif how == "magic":
        data[:6] = b"NOTNPY"
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    if reseal and name.endswith(".npy"):
        reseal_array(table, name[:-4])


def set_field(path: str, value, reseal: bool = True):
    """A damage: the manifest field at dotted `path` set to `value` (or deleted: DELETE)."""
    def damage(table):
        m = manifest(table)
        *parents, leaf = path.split(".")
        node = m
        for p in parents:
            node = node[p]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
        write_manifest(table, m, reseal)
    return damage


DELETE = object()


# --- the catalogue ----------------------------------------------------------------------

@dataclass
class Case:
    id: str
    damage: Callable[[str], None]
    match: str  # a regex the error message must match (besides naming the table)
    needs_verify: bool = False  # caught only by the checks `--no-verify` skips (checksums, unique keys)


def template_manifest() -> dict:
    sf = CONFIG.state_floats
    shapes = {"keys": [N], "rows": [N, CONFIG.dim], "optimizer_state": [N, sf], "counts": [N], "last_steps": [N]}
    config = json.loads(json.dumps(config_to_dict(CONFIG)))  # as a manifest holds it (betas: a list)
    return {"format": "cn-table", "version": 3, "rows": N, "step": 9, "evicted": 0, "config": config,
            "arrays": {name: {"file": f"{name}.npy", "dtype": np.dtype(t).str, "shape": shapes[name], "bytes": 0,
                              "sha256": "0" * 64} for name, t in ARRAYS.items()}}


def leaves(node, prefix=""):
    """(dotted path, value) of every field of a manifest, containers included."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        yield path, value
        if isinstance(value, dict):
            yield from leaves(value, path + ".")


NAN, INF = float("nan"), float("inf")


def type_lies(value) -> list:
    """Values of the wrong kind (or out of range) for a field holding `value`: never valid."""
    if isinstance(value, bool):
        raise AssertionError("no bool fields")
    if isinstance(value, int):
        return [None, True, "7", 1.5, -1, 2**64, [], {}]
    if isinstance(value, float):
        return [None, True, "0.5", NAN, INF, -INF, [], {}]
    if isinstance(value, str):
        return [None, 7, "", "x" * 300, [], {}]
    if isinstance(value, list):
        return [None, "x", {}, [None] * len(value), value + [1]]
    if isinstance(value, dict):
        return [None, 7, "x", [], {}]
    if value is None:
        return []
    raise AssertionError(value)


def field_match(path: str) -> str:
    """The message must name the field: its first and last components (so 'config.dim' or
    'config: dim ...', 'arrays.rows.shape'). A lie in a config class's field may be named
    by the class (`Adam.lr`), which the constructor reports."""
    parts = path.split(".")
    return ".*".join(re.escape(p) for p in (parts[0], parts[-1]) if p) if len(parts) > 1 else re.escape(parts[0])


def manifest_cases() -> list:
    cases = []
    m = template_manifest()
    for path, value in leaves(m):
        # The message must name the field; a lie in a whole container is named by it.
        match = field_match(path)
        if path.startswith("arrays.") and path.endswith(".bytes"):
            match = field_match(path) + "|" + re.escape(path.split(".")[1] + ".npy")
        lies = type_lies(value)
        if path == "version":
            lies = [lie for lie in lies if lie != 2**64] + [0]  # 2**64: "newer than this reader" below
        if path == "format":
            match = "not a cn-table table"
        for i, lie in enumerate(lies):
            cases.append(Case(f"{path}={_short(lie)}#{i}", set_field(path, lie), match))
        cases.append(Case(f"{path}:deleted", set_field(path, DELETE),
                          "format" if path == "format" else match if "." in path else f"missing.*{re.escape(path)}"))
    # Type-valid values that lie about the data: only the cross-checks can catch these.
    cases += [
        Case("format=other", set_field("format", "cn-table-2"), "not a cn-table table"),
        Case("version=4", set_field("version", 4), "newer than this reader"),
        # a version 2 manifest has no eviction counter, and its rows are float32 whatever the dtype
        Case("version=2,evicted", set_field("version", 2), r"the manifest must have the fields.*unknown.*evicted"),
        Case("config.dtype=bfloat16", set_field("config.dtype", "bfloat16"), r"arrays\.rows\.dtype must be '<u2'"),
        Case("config.dtype=float16", set_field("config.dtype", "float16"), r"arrays\.rows\.dtype must be '<f2'"),
        Case("rows+1", set_field("rows", N + 1), r"arrays\.keys\.shape.*rows=7"),
        Case("rows-1", set_field("rows", N - 1), r"arrays\.keys\.shape.*rows=5"),
        Case("rows=0", set_field("rows", 0), r"arrays\.keys\.shape.*rows=0"),
        Case("config.dim+1", set_field("config.dim", CONFIG.dim + 1), r"arrays\.rows\.shape.*config\.dim=4"),
        Case("config.dim-1", set_field("config.dim", CONFIG.dim - 1), r"arrays\.rows\.shape.*config\.dim=2"),
        Case("config.dim=0", set_field("config.dim", 0), "config.*dim"),
        Case("config.dim=65537", set_field("config.dim", 65537), "config.*dim"),
        Case("config.dtype=float64", set_field("config.dtype", "float64"), "config.*dtype"),
        Case("config.optimizer=null", set_field("config.optimizer", None),
             r"arrays\.optimizer_state\.shape.*config\.optimizer=None: 0 state floats"),
        Case("config.optimizer=SGD", set_field("config.optimizer", {"type": "SGD", "lr": 0.1}),
             r"arrays\.optimizer_state\.shape.*config\.optimizer=SGD"),
        Case("config.optimizer=Adagrad", set_field("config.optimizer", config_to_dict(
            cncore.StoreConfig(dim=3, optimizer=cncore.Adagrad()))["optimizer"]),
             r"arrays\.optimizer_state\.shape.*config\.optimizer=Adagrad"),
        Case("config.optimizer.betas=[0.9]", set_field("config.optimizer.betas", [0.9]), "config.optimizer"),
        Case("config.optimizer.betas=[1,1]", set_field("config.optimizer.betas", [1.0, 1.0]), "config.optimizer"),
        Case("config.optimizer.extra", set_field("config.optimizer.evil", 1), r"config\.optimizer.*unknown.*evil"),
        Case("config.initializer.extra", set_field("config.initializer.evil", 1), r"config\.initializer.*evil"),
        Case("config.extra", set_field("config.evil", 1), r"config.*unknown.*evil"),
        Case("manifest.extra", set_field("evil", 1), r"manifest.*unknown.*evil"),
        Case("arrays.extra", set_field("arrays.evil", {}), r"arrays.*unknown.*evil"),
        Case("config.initializer.std=0", set_field("config.initializer.std", 0.0), "config.initializer.*std"),
        Case("config.initializer.low>high", set_field("config.initializer.low", 5.0), "config.initializer.*low"),
        Case("config.optimizer.lr<0", set_field("config.optimizer.lr", -0.1), "config.optimizer.*lr"),
        Case("config.max_load_factor=1", set_field("config.max_load_factor", 1.0), "config.*max_load_factor"),
    ]
    # The `type` whitelist: nothing but the config classes may be built from a file.
    for family, kinds in (("initializer", ["set_num_threads", "StoreConfig", "EmbeddingStore", "Adam", "__class__",
                                           "get_num_threads", "uniform"]),
                          ("optimizer", ["set_num_threads", "StoreConfig", "EmbeddingStore", "Uniform", "__class__",
                                         "Optimizer", "sgd"])):
        for kind in kinds:
            cases.append(Case(f"config.{family}.type={kind}", set_field(f"config.{family}.type", kind),
                              rf"config\.{family}\.type must be one of"))
    cases.append(Case("config.initializer=set_num_threads(n)", set_field(
        "config.initializer", {"type": "set_num_threads", "n": 100000}), r"config\.initializer\.type"))
    # Per array: paths that leave the version directory, other arrays' files, other dtypes and shapes.
    for name, dtype in ARRAYS.items():
        at = f"arrays.{name}"
        for lie in ["../../escape.npy", "../escape.npy", "/tmp/escape.npy", "ESCAPE", "keys.npy" if name != "keys"
                    else "rows.npy", f"./{name}.npy", f"{name}.npy/", f"{name}.npy\0", f"sub/{name}.npy"]:
            cases.append(Case(f"{at}.file={lie!r}", set_field(f"{at}.file", lie), rf"{re.escape(at)}\.file"))
        # sorted: pytest-xdist workers must collect the same cases in the same order
        lies = {"<i8", "<f4", "<u4", "<f8", ">" + np.dtype(dtype).str[1:], "|u1", "<i4"} - {np.dtype(dtype).str}
        for lie in sorted(lies):
            cases.append(Case(f"{at}.dtype={lie}", set_field(f"{at}.dtype", lie), rf"{re.escape(at)}\.dtype"))
        shape = template_manifest()["arrays"][name]["shape"]
        for lie in [[N + 1] + shape[1:], [N - 1] + shape[1:], shape + [1], shape[:1], [N, 0], [],
                    [float(v) for v in shape], [True] + shape[1:]]:
            if lie != shape and not (lie == shape[:1] and len(shape) == 1):
                cases.append(Case(f"{at}.shape={lie}", set_field(f"{at}.shape", lie), rf"{re.escape(at)}\.shape"))
        cases.append(Case(f"{at}.bytes+1", lambda t, at=at: set_field(f"{at}.bytes", manifest(t)["arrays"][
            at.split(".")[1]]["bytes"] + 1)(t), rf"{re.escape(name)}\.npy has \d+ bytes"))
        cases.append(Case(f"{at}.sha256=zeros", set_field(f"{at}.sha256", "0" * 64),
                          rf"{re.escape(name)}\.npy.*SHA-256", needs_verify=True))
        cases.append(Case(f"{at}.sha256=upper", lambda t, at=at: set_field(f"{at}.sha256", manifest(t)["arrays"][
            at.split(".")[1]]["sha256"].upper())(t), rf"{re.escape(at)}\.sha256"))
    # A manifest edited without resealing its checksum.
    for path, lie in (("config.dim", 4), ("rows", N - 1), ("step", 10), ("config.optimizer", None)):
        cases.append(Case(f"{path}={lie}:checksum-stale", set_field(path, lie, reseal=False),
                          r"manifest\.json fails its SHA-256 check"))
    # Self-consistent manifest lies (every shape agrees with the edited rows / dim): the files disagree.
    def consistent_rows(t):
        m = manifest(t)
        m["rows"] = N + 2
        for entry in m["arrays"].values():
            entry["shape"][0] = N + 2
        write_manifest(t, m)
    def consistent_dim(t):
        m = manifest(t)
        m["config"]["dim"] = 2 * CONFIG.dim
        m["arrays"]["rows"]["shape"][1] = 2 * CONFIG.dim
        m["arrays"]["optimizer_state"]["shape"][1] = 4 * CONFIG.dim
        write_manifest(t, m)
    cases += [Case("rows+2:consistent", consistent_rows, r"keys\.npy holds <i8 \(6,\), the manifest says <i8 \(8,\)"),
              Case("config.dim*2:consistent", consistent_dim, r"rows\.npy holds <f4 \(6, 3\), the manifest says")]
    return cases


def _short(value) -> str:
    return repr(value)[:20].replace("\0", "NUL")


def file_cases() -> list:
    cases = []
    for name, dtype in ARRAYS.items():
        file = f"{name}.npy"
        for how in ("truncate-1", "header-only", "empty", "extend", "flip-header", "magic"):
            for reseal in (False, True):
                match = rf"{re.escape(file)} (has \d+ bytes|has no readable \.npy header|holds)"
                cases.append(Case(f"{file}:{how}:{'resealed' if reseal else 'stale'}",
                                  lambda t, f=file, h=how, r=reseal: edit_bytes(t, f, h, r), match))
        cases.append(Case(f"{file}:flip-last", lambda t, f=file: edit_bytes(t, f, "flip-last", False),
                          rf"{re.escape(file)} fails its SHA-256 check", needs_verify=True))
        cases.append(Case(f"{file}:missing", lambda t, f=file: os.remove(os.path.join(version_dir(t), f)),
                          rf"{re.escape(file)} is missing"))
        cases.append(Case(f"{file}:directory", lambda t, f=file: (os.remove(os.path.join(version_dir(t), f)),
                                                                   os.mkdir(os.path.join(version_dir(t), f))),
                          rf"{re.escape(file)}"))
        # Header lies, with the manifest's bytes and checksum resealed: only the header check sees them.
        cases.append(Case(f"{file}:fortran", lambda t, n=name: write_npy(t, n, array(t, n), fortran=True),
                          rf"{re.escape(file)} is Fortran-ordered"))
        other = np.float64 if dtype != np.float64 else np.float32
        cases.append(Case(f"{file}:header-dtype", lambda t, n=name, o=other: write_npy(t, n, array(t, n).astype(o)),
                          rf"{re.escape(file)} holds <f8"))
        cases.append(Case(f"{file}:big-endian", lambda t, n=name: write_npy(
            t, n, array(t, n).astype(array(t, n).dtype.newbyteorder(">"))), rf"{re.escape(file)} holds >"))
        cases.append(Case(f"{file}:header-shape-short", lambda t, n=name: write_npy(t, n, array(t, n)[:-1]),
                          rf"{re.escape(file)} holds \S+ \(5"))
        if name in ("rows", "optimizer_state"):
            cases.append(Case(f"{file}:header-shape-flat", lambda t, n=name: write_npy(t, n, array(t, n).reshape(-1)),
                              rf"{re.escape(file)} holds"))
    def duplicate_key(t):
        keys = array(t, "keys")
        keys[1] = keys[0]
        write_npy(t, "keys", keys)
    cases.append(Case("keys.npy:duplicate-key", duplicate_key, r"keys\.npy holds duplicate keys", needs_verify=True))
    # The manifest and its checksum file.
    vd = lambda t, f: os.path.join(version_dir(t), f)  # noqa: E731
    cases += [
        Case("manifest.json:missing", lambda t: os.remove(vd(t, "manifest.json")), r"manifest\.json is missing"),
        Case("manifest.json:not-json", lambda t: write_manifest(t, None, text=b"{ not json"),
             r"manifest\.json is damaged"),
        Case("manifest.json:not-json-stale", lambda t: write_manifest(t, None, False, b"{ not json"),
             r"manifest\.json fails its SHA-256"),
        Case("manifest.json:empty", lambda t: write_manifest(t, None, text=b""), r"manifest\.json is damaged"),
        Case("manifest.json:binary", lambda t: write_manifest(t, None, text=bytes(range(256))),
             r"manifest\.json is damaged"),
        Case("manifest.json:list", lambda t: write_manifest(t, [1, 2]), r"manifest must be an object"),
        Case("manifest.json:string", lambda t: write_manifest(t, "cn-table"), r"manifest must be an object"),
        Case("manifest.json:null", lambda t: write_manifest(t, None, text=b"null"), r"manifest must be an object"),
        Case("manifest.json:deep", lambda t: write_manifest(t, None, text=b"[" * 100000 + b"]" * 100000),
             r"manifest\.json is damaged"),
        Case("manifest.json:huge-int", lambda t: write_manifest(t, None, text=b'{"rows": ' + b"9" * 5000 + b"}"),
             r"manifest\.json is damaged"),
        Case("manifest.json:directory", lambda t: (os.remove(vd(t, "manifest.json")), os.mkdir(vd(t, "manifest.json"))),
             r"manifest\.json"),
        Case("manifest.sha256:missing", lambda t: os.remove(vd(t, "manifest.sha256")), r"manifest\.sha256 is missing"),
        Case("manifest.sha256:garbage", lambda t: open(vd(t, "manifest.sha256"), "w").write("garbage\n"),
             r"manifest\.json fails its SHA-256 check"),
        Case("manifest.sha256:empty", lambda t: open(vd(t, "manifest.sha256"), "w").close(),
             r"manifest\.json fails its SHA-256 check"),
        Case("manifest.sha256:directory", lambda t: (os.remove(vd(t, "manifest.sha256")),
                                                     os.mkdir(vd(t, "manifest.sha256"))), r"manifest\.sha256"),
    ]
    # CURRENT.
    cur = lambda t: os.path.join(t, "CURRENT")  # noqa: E731
    for label, text in (("empty", b""), ("garbage", b"garbage"), ("short", b"v1"), ("unicode-digits",
                        "v\u0663\u0663\u0663\u0663\u0663\u0663".encode()), ("traversal", b"../v000001"),
                        ("absolute", b"/tmp"), ("binary", bytes(range(256))), ("two-lines", b"v000001\nv000002")):
        cases.append(Case(f"CURRENT:{label}", lambda t, x=text: open(cur(t), "wb").write(x), r"CURRENT is damaged"))
    cases += [
        Case("CURRENT:missing", lambda t: os.remove(cur(t)), r"no CURRENT"),
        Case("CURRENT:directory", lambda t: (os.remove(cur(t)), os.mkdir(cur(t))), r"CURRENT"),
        Case("CURRENT:names-no-version", lambda t: open(cur(t), "w").write("v000002\n"),
             r"v000002/manifest\.json is missing"),
        Case("version-dir:missing", lambda t: shutil.rmtree(version_dir(t)), r"v000001/manifest\.json is missing"),
    ]
    return cases


CATALOGUE = manifest_cases() + file_cases()
DAMAGE_CASES = len(CATALOGUE)


def snapshot(root: str) -> dict:
    """Every file and directory under `root`, with its bytes (file) or None (directory)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.join(dirpath, d)] = None
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.join(dirpath, f)] = fh.read()
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("template") / "t")
    rng = np.random.default_rng(0)
    with TableWriter(path, CONFIG, N, step=9) as w:
        w.write(KEYS, rng.standard_normal((N, CONFIG.dim)).astype(np.float32),
                rng.random((N, CONFIG.state_floats)).astype(np.float32), np.arange(N) * 3, np.arange(N) + 1)
    return path


def test_the_catalogue_is_large_and_unique(template):
    print(f"{DAMAGE_CASES} damaged-table cases")
    assert DAMAGE_CASES >= 400
    assert len({c.id for c in CATALOGUE}) == DAMAGE_CASES
    # The template itself is a good table, and its manifest has exactly the fields the catalogue walks.
    assert len(open_table(template)) == N
    real, walked = manifest(template), template_manifest()
    assert [p for p, _ in leaves(real)] == [p for p, _ in leaves(walked)]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_damage_is_refused(template, tmp_path, case, capsys):
    table = str(tmp_path / "t")
    shutil.copytree(template, table)
    # A valid copy of an array just outside the table: a reader that followed a path out of the
    # version directory would find a plausible file there (and the "/tmp/escape.npy" lie).
    shutil.copy(os.path.join(version_dir(table), "rows.npy"), str(tmp_path / "escape.npy"))
    case.damage(table)
    before = snapshot(str(tmp_path))
    with pytest.raises(TableFormatError, match=re.escape(table) + ".*(" + case.match + ")"):
        open_table(table)
    capsys.readouterr()
    out = str(tmp_path / "out.npz")
    runs = [["inspect", table], ["export", table, out]] + [["inspect", table, "--no-verify", "--json"]] * (
        not case.needs_verify)
    for argv in runs:
        assert cn_table(argv + ["--quiet"]) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"cn-table {argv[0]}: error: {table}"), captured.err
        assert "Traceback" not in captured.err and captured.out == ""
    assert snapshot(str(tmp_path)) == before  # no export, no temporaries, nothing edited


def test_a_traversal_lie_discloses_nothing_about_the_other_file(template, tmp_path):
    table = str(tmp_path / "t")
    shutil.copytree(template, table)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 12345)
    set_field("arrays.rows.file", "../../secret.bin")(table)
    with pytest.raises(TableFormatError, match=r"arrays\.rows\.file must be 'rows\.npy'") as info:
        open_table(table)
    assert "12345" not in str(info.value)


def test_the_type_whitelist_calls_nothing(template, tmp_path, monkeypatch):
    """{"type": "set_num_threads", "n": ...} used to call cncore.set_num_threads(n=...) before
    the open was refused."""
    calls = []
    monkeypatch.setattr(cncore, "set_num_threads", lambda *a, **k: calls.append((a, k)))
    table = str(tmp_path / "t")
    shutil.copytree(template, table)
    set_field("config.optimizer", {"type": "set_num_threads", "n": 100000})(table)
    with pytest.raises(TableFormatError, match=r"config\.optimizer\.type must be one of"):
        open_table(table)
    assert calls == []


@pytest.mark.parametrize("case_id", ["arrays.rows.file='../../escape.npy'", "config.initializer.type=set_num_threads",
                                     "rows.npy:fortran"])
def test_the_real_command_refuses_in_one_line(template, tmp_path, case_id):
    """A few cases through a real `cn-table` process: exit 2, one line, no traceback."""
    case = next(c for c in CATALOGUE if c.id == case_id)
    table = str(tmp_path / "t")
    shutil.copytree(template, table)
    case.damage(table)
    for argv in (["inspect", table], ["export", table, str(tmp_path / "out.parquet")]):
        proc = subprocess.run([sys.executable, "-m", "cncore_numpy.cli"] + argv + ["--quiet"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"cn-table {argv[0]}: error: {table}: ")
        assert re.search(case.match, proc.stderr)
    assert sorted(os.listdir(tmp_path)) == ["t"]
