"""The options of `cn-dlrm`, their checks, and `InputError`: what the launcher (`cli.py`) parses
before torch loads and what every part of the job (`train.py`, `distributed.py`, `bounded.py`,
`chains.py`, `data.py`) reads. It imports no deep learning framework, so `--help` and a mistake
in an option answer at once.

>>> args = parse_args(["--steps", "10", "--max-rows", "25%"])
>>> args.steps, args.evict, row_budget(args.max_rows)
(10, 'lru', (None, 25.0))
"""
from __future__ import annotations

import argparse
import os

__all__ = ["InputError", "build_parser", "parse_args", "row_budget", "chains_world_size", "ROW_DTYPES", "EVICTIONS"]


# The command's description in `--help`.
DESCRIPTION = """cn-dlrm: train TorchRec's DLRM on dynamic tables, with progress, throughput and AUC.

    cn-dlrm                                  # the embedded synthetic Criteo-like stream
    cn-dlrm --criteo-tsv day_0.gz            # real Criteo Kaggle / 1TB text files
    cn-dlrm --compare                        # the same run on TorchRec's fixed tables, side by side
    cn-dlrm --nproc 2                        # 2 local processes (gloo), tables sharded row-wise over them
    cn-dlrm --checkpoint ck.pt --resume ck.pt --summary-json out.json
    cn-dlrm --max-rows 25% --evict lfu       # bounded tables: a row budget per table, rows evicted past it
    cn-dlrm --max-rows 20000 --checkpoint ck --incremental-checkpoint-every 100   # table chains in ck/
    cn-dlrm --nproc 2 --max-rows 50% --checkpoint ck --incremental-checkpoint-every 100   # a chain per rank

Bounded tables: --max-rows N gives every table a budget of N rows; --max-rows P% gives each
table P% of the distinct IDs the training range brings to it (synthetic data: counted in a pass
over the stream before training), but never less than the most distinct IDs one training batch
brings to it (a lookup never evicts its own rows). Past its budget a table evicts by --evict
(lru: least recently used; lfu: least often used; ttl: rows unused for more than --ttl-steps
steps, also swept every step without pressure). --admit-min-count C gives an ID a row only once
it was seen C times (a count-min sketch; until then it reads as zeros and is not trained);
--admit-probability P gives it a row with probability P, decided once per ID (refused IDs read as
zeros and are never trained). Every table keeps a row per ID (fallback_rows=0); --auto-split
lets each table choose when it fills whether to split its budget into keyed and shared
fallback rows (fallback_rows="auto"; one process, no admission).

Evaluation: on synthetic data, the --eval-batches batches that follow the training range (drift
and unseen IDs included); on a Criteo file, its first --eval-batches x --batch-size lines, which
are held out (training starts on the line after them).
"""


class InputError(ValueError):
    """Bad input data (a Criteo file, a checkpoint, a path an option names): `cn-dlrm` prints the
    message as one line and exits with code 2. Raised while training too, since the file is read
    as the run goes."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line: the usage block would push the reason out of a log's last line.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):
        # Show defaults that are values; "(default: None)" on an optional path says nothing.
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return f"{action.help} (default: %(default)s)"


def _probability(text: str) -> float:
    """A number in (0, 1] (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _zipf_alpha(text: str) -> float:
    """--zipf-alpha: a Zipf exponent, a finite number above 1 (NumPy's Zipf sampler needs it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {text!r}") from None
    if not 1 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 1 (a Zipf exponent), got {text}")
    return value


def _row_budget(text: str) -> str:
    """--max-rows: 'N' (rows per table, N >= 1) or 'P%' (0 < P <= 100); returned in canonical form."""
    t = text.strip()
    if t.endswith("%"):
        try:
            value = float(t[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected rows per table (N) or a percentage (P%), "
                                             f"got {text!r}") from None
        if not 0 < value <= 100:
            raise argparse.ArgumentTypeError(f"a percentage must be in (0, 100], got {text}")
        return f"{value:g}%"
    return str(_int_at_least(1)(t))


def row_budget(text: str | None):
    """(rows per table, percent of each table's distinct IDs) of a --max-rows value, one of them None.

    >>> row_budget("4096"), row_budget("25%"), row_budget(None)
    ((4096, None), (None, 25.0), (None, None))
    """
    if text is None:
        return None, None
    return (None, float(text[:-1])) if text.endswith("%") else (int(text), None)


ROW_DTYPES = ("float32", "float16", "bfloat16")
EVICTIONS = ("lru", "lfu", "ttl")
# Options the distributed path (--nproc > 1, torchrun) does not run yet, with their defaults
# (none now: every option runs on several processes).
NOT_DISTRIBUTED: dict = {"prefill": False}


def _input_file(text: str) -> str:
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"not a file: {text}")
    return text


def _input_path(text: str) -> str:
    """A file, or a directory (an incremental checkpoint)."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def _output_path(text: str) -> str:
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: the folder {folder} is not writable")
    return text


def _output_file(text: str) -> str:
    _output_path(text)
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot write {text}: it is a folder")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="cn-dlrm", description=DESCRIPTION, formatter_class=_Formatter)
    ap.add_argument("--steps", type=_int_at_least(1), default=800,
                    help="training batches, counted from the start of the run (a resumed run continues to it)")
    ap.add_argument("--batch-size", type=_int_at_least(1), default=2048, help="samples per batch")
    ap.add_argument("--embedding-dim", type=_int_at_least(1), default=16, help="row width of every table")
    ap.add_argument("--sparse-lr", type=_positive_float, default=0.05, help="row-wise Adagrad on the tables")
    ap.add_argument("--dense-lr", type=_positive_float, default=0.01, help="Adagrad on the dense network")
    ap.add_argument("--eval-every", type=_int_at_least(1), default=200, help="evaluate every this many steps")
    ap.add_argument("--eval-batches", type=_int_at_least(1), default=8,
                    help="evaluation batches (on a Criteo file: its first eval-batches x batch-size lines)")
    ap.add_argument("--seed", type=_int_at_least(0), default=0, help="data and initialisation seed")
    ap.add_argument("--threads", type=_int_at_least(1), default=None,
                    help="threads for torch and the core (default: all cores)")
    ap.add_argument("--criteo-tsv", metavar="PATH", type=_input_file, default=None,
                    help="train on a Criteo Kaggle / 1TB text file (.gz too) instead of synthetic data: label "
                         "0/1, 13 integers (ASCII digits, '-' allowed; empty or negative read as 0), 26 categories "
                         "of lower-case hex digits (8 in Criteo's files, up to 16 for 64-bit IDs; empty: no ID), "
                         "tab-separated; any other spelling stops the job naming the line")
    ap.add_argument("--summary-json", metavar="PATH", type=_output_file, default=None,
                    help="also write the final summary as JSON")
    ap.add_argument("--checkpoint", metavar="PATH", type=_output_path, default=None,
                    help="save model and optimizers here, at every evaluation and at the end (with "
                         "--incremental-checkpoint-every: a directory of table chains, see below)")
    ap.add_argument("--resume", metavar="PATH", type=_input_path, default=None,
                    help="continue from a checkpoint of this job, a file or an --incremental-checkpoint-every "
                         "directory (--steps must be above its step)")
    ap.add_argument("--compare", action="store_true",
                    help="also train TorchRec on the same data: its EmbeddingBagCollection on collision-free tables "
                         "(IDs remapped to 0..N-1; synthetic data), DistributedModelParallel with fused FBGEMM "
                         "tables (gloo, world size 1; synthetic data), and its EmbeddingBagCollection with IDs "
                         "hashed modulo fixed tables of the same memory; print all runs")
    ap.add_argument("--nproc", type=_int_at_least(1), default=1,
                    help="train on this many local processes (gloo on 127.0.0.1), every table sharded row-wise "
                         "over them by key hash (TorchRec's DistributedModelParallel); --batch-size is the global "
                         "batch, split between them (with --criteo-tsv each process parses its share of the lines); "
                         "with --compare, TorchRec's row-wise sharded FBGEMM tables under the same DMP")
    bounded = ap.add_argument_group("bounded tables (see above)")
    bounded.add_argument("--max-rows", metavar="N|P%", type=_row_budget, default=None,
                         help="row budget of every table: N rows (at least --batch-size), or P%% of each table's "
                              "distinct training IDs (synthetic data)")
    bounded.add_argument("--evict", choices=EVICTIONS, default=None,
                         help="which rows go when a table is past its budget (default with --max-rows: lru); ttl "
                              "also expires rows unused for --ttl-steps steps, with or without --max-rows")
    bounded.add_argument("--ttl-steps", metavar="S", type=_int_at_least(0), default=None,
                         help="with --evict ttl: rows unused for more than S steps expire")
    bounded.add_argument("--lfu-halve-every", metavar="S", type=_int_at_least(1), default=None,
                         help="with --evict lfu: a row's count counts half for every S steps it goes unused "
                              "(cncore.LFU(halve_every=S); a power of two), so rows popular once do not stay forever")
    bounded.add_argument("--auto-split", action="store_true",
                         help="with --max-rows, on one process, without admission: each table may split its budget "
                              "into keyed and shared fallback rows when it fills (fallback_rows='auto', "
                              "docs/bounded-tables.md); by default every table keeps a row per ID")
    admit = bounded.add_mutually_exclusive_group()
    admit.add_argument("--admit-min-count", metavar="C", type=_int_at_least(1), default=None,
                       help="an ID gets a row only once it was seen C times")
    admit.add_argument("--admit-probability", metavar="P", type=_probability, default=None,
                       help="an ID gets a row with probability P, drawn once per (table seed, ID) "
                            "(cncore.Probability)")
    bounded.add_argument("--incremental-checkpoint-every", metavar="K", type=_int_at_least(1), default=None,
                         help="with --checkpoint DIR: every K steps (and at the end) save each table as a table "
                              "file chain (a delta of the rows changed since the last save) in DIR/tables/ (on N "
                              "processes, each its own shard's: DIR/tables/<table>/shard-R-of-N/), and the dense "
                              "model in DIR/dense.pt")
    tier = ap.add_argument_group("tables larger than memory (the SSD tier)")
    tier.add_argument("--ssd-path", metavar="DIR", default=None,
                      help="keep every table's rows on disk in DIR/<table>/ (DIR/rank<r>/<table>/ on several "
                           "processes) under a memory cache of --cache-mb; DIR must be new or empty")
    tier.add_argument("--cache-mb", metavar="N", type=_int_at_least(1), default=None,
                      help="with --ssd-path: MiB of rows held in memory, shared between the tables by their size")
    synthetic = ap.add_argument_group("the synthetic stream")
    synthetic.add_argument("--data-scale", metavar="S", type=_positive_float, default=None,
                           help="each table's items as this fraction of Criteo Kaggle's cardinalities (default "
                                "0.01; 1.0: 33.8M items, before drift)")
    synthetic.add_argument("--zipf-alpha", metavar="A", type=_zipf_alpha, default=None,
                           help="how skewed the items' popularity is: the Zipf exponent of each feature's item "
                                "ranks (above 1; default 1.2; 1.05: a longer tail, more distinct IDs a batch)")
    synthetic.add_argument("--prefill", action="store_true",
                           help="before training, give every table a row for each item the run can reach (rows "
                                "from the table's initializer): tables the size of a long-trained model's, e.g. "
                                "--data-scale 1 --prefill, for the SSD tier")
    ap.add_argument("--row-dtype", choices=ROW_DTYPES, default="float32",
                    help="storage type of the tables' rows (optimizer state and outputs stay float32)")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar or progress lines, only evaluations (off a terminal, plain progress "
                         "lines replace the bar)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's options, checked; a bad one exits with code 2 and one line naming it.

    >>> parse_args(["--steps", "10"]).steps, parse_args([]).batch_size
    (10, 2048)
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    world = args.nproc if args.nproc > 1 else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:  # (torchrun sets WORLD_SIZE)
        given = [f"--{k.replace('_', '-')}" for k, default in NOT_DISTRIBUTED.items() if getattr(args, k) != default]
        if given:
            ap.error(f"{', '.join(given)} do{'es' if len(given) == 1 else ''} not run on {world} processes yet "
                     f"(only with --nproc 1)")
    _check_bounded(ap, args, world)
    _check_tier(ap, args)
    _check_synthetic(ap, args)
    _check_paths(ap, args)
    if args.nproc > 1:
        if args.compare and args.batch_size % args.nproc:
            ap.error(f"--compare with --nproc {args.nproc} needs --batch-size a multiple of {args.nproc}: TorchRec's "
                     f"row-wise tables need equal batches on every process (gloo), {args.batch_size} does not split")
    return args


def _check_paths(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """No file the job writes is one it reads (or another it writes), except --checkpoint P
    --resume P: a checkpoint continued in place."""
    outputs = [(o, p) for o, p in (("--checkpoint", args.checkpoint), ("--summary-json", args.summary_json),
                                   ("--ssd-path", args.ssd_path)) if p]
    named = [*outputs, *[(o, p) for o, p in (("--criteo-tsv", args.criteo_tsv), ("--resume", args.resume)) if p]]
    for i, (out, path) in enumerate(outputs):
        for other, other_path in named[i + 1:]:
            if {out, other} != {"--checkpoint", "--resume"} and \
                    os.path.realpath(path) == os.path.realpath(other_path):
                ap.error(f"{out} {path} is also {other} {other_path}: the job would write over it; give another path")


def _check_synthetic(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--data-scale, --zipf-alpha and --prefill shape the synthetic stream and its tables."""
    if args.criteo_tsv is not None:
        given = [f for f, v in (("--data-scale", args.data_scale), ("--zipf-alpha", args.zipf_alpha),
                                ("--prefill", args.prefill)) if v]
        if given:
            ap.error(f"{' and '.join(given)} shape{'s' if len(given) == 1 else ''} the synthetic stream, not "
                     f"--criteo-tsv {args.criteo_tsv}")
    if args.data_scale is None:
        args.data_scale = 0.01
    if args.zipf_alpha is None:
        args.zipf_alpha = 1.2
    if args.prefill:
        if args.max_rows is not None:
            ap.error("--prefill gives every table a row for each item, which --max-rows would evict at once")
        if args.resume is not None:
            ap.error("--prefill builds the tables, which --resume loads from its checkpoint")


def _check_tier(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--ssd-path and --cache-mb go together, on a fresh directory, without a row budget
    (admission, --admit-min-count, works on the tier as in memory)."""
    if (args.ssd_path is None) != (args.cache_mb is None):
        ap.error("--ssd-path DIR and --cache-mb N go together (the rows on disk, and the memory in front of them)")
    if args.ssd_path is None:
        return
    if os.path.exists(args.ssd_path) and (not os.path.isdir(args.ssd_path) or os.listdir(args.ssd_path)):
        ap.error(f"--ssd-path {args.ssd_path}: must be a new or empty directory (the job writes its tables there)")
    if args.max_rows is not None:
        ap.error("--ssd-path keeps every row (on disk): it does not go with --max-rows (its memory is --cache-mb)")


def _check_bounded(ap: argparse.ArgumentParser, args: argparse.Namespace, world: int = 1) -> None:
    """The bounded-table options together: what each needs, and what cannot go with what."""
    rows, percent = row_budget(args.max_rows)
    if args.max_rows is not None and args.evict is None:
        args.evict = "lru"
    if args.evict in ("lru", "lfu") and args.max_rows is None:
        ap.error(f"--evict {args.evict} needs --max-rows (it chooses rows to evict past a budget)")
    if args.evict == "ttl" and args.ttl_steps is None:
        ap.error("--evict ttl needs --ttl-steps S (rows unused for more than S steps expire)")
    if args.auto_split and args.max_rows is None:
        ap.error("--auto-split splits a row budget: set --max-rows too")
    if args.auto_split and (args.admit_min_count is not None or args.admit_probability is not None):
        ap.error("--auto-split chooses from every ID's arrival, which admission hides: leave out --admit-min-count / "
                 "--admit-probability")
    if args.auto_split and world > 1:
        ap.error(f"--auto-split: this job's checkpoints of several processes merge the ranks' tables (merge_shards), "
                 f"which refuses a shard's fallback rows; run on one process (this run has {world})")
    if args.ttl_steps is not None and args.evict != "ttl":
        ap.error(f"--ttl-steps applies to --evict ttl, not {'no --evict' if args.evict is None else args.evict}")
    if args.lfu_halve_every is not None:
        if args.evict != "lfu":
            ap.error(f"--lfu-halve-every applies to --evict lfu, not "
                     f"{'no --evict' if args.evict is None else args.evict}")
        if args.lfu_halve_every & (args.lfu_halve_every - 1) or args.lfu_halve_every > 2**31:
            ap.error(f"--lfu-halve-every must be a power of two up to 2**31, got {args.lfu_halve_every}")
    if rows is not None and rows < args.batch_size * world:
        shard = f" to each of the {world} shards of a table (ceil(max_rows / {world}) rows each)" if world > 1 else \
            " to a table"
        ap.error(f"--max-rows {rows} is below {'--batch-size' if world == 1 else f'{world} x --batch-size'} "
                 f"{args.batch_size * world}: one batch can bring {args.batch_size} distinct IDs{shard}, and a "
                 f"lookup never evicts its own rows")
    if percent is not None and args.criteo_tsv:
        ap.error(f"--max-rows {args.max_rows} counts distinct IDs in the synthetic stream; with --criteo-tsv "
                 f"give rows per table (--max-rows N)")
    if args.incremental_checkpoint_every is not None:
        if not args.checkpoint:
            ap.error("--incremental-checkpoint-every needs --checkpoint DIR (the directory of the table chains)")
        if os.path.exists(args.checkpoint) and not os.path.isdir(args.checkpoint):
            ap.error(f"--checkpoint {args.checkpoint} is a file; with --incremental-checkpoint-every it names a "
                     f"directory")
        saved = chains_world_size(args.checkpoint)
        if saved is not None and saved != world:
            ap.error(f"--checkpoint {args.checkpoint} holds table chains of {saved} process{'es' * (saved > 1)}; "
                     f"this run has {world} (each writes its own shard): give a new directory (--resume "
                     f"{args.checkpoint} reads it on any number of processes)")
    elif args.checkpoint and os.path.isdir(args.checkpoint):
        ap.error(f"cannot write {args.checkpoint}: it is a folder (a folder is for --incremental-checkpoint-every)")


def chains_world_size(directory: str) -> int | None:
    """The number of processes whose table chains `directory` (an --incremental-checkpoint-every
    directory) holds: 1 when its tables are table directories, W when they hold shard-R-of-W
    directories; None when it holds none.

    >>> chains_world_size("/no/such/directory") is None
    True
    """
    tables = os.path.join(directory, "tables")
    if not os.path.isdir(tables):
        return None
    for name in sorted(os.listdir(tables)):
        entries = os.listdir(os.path.join(tables, name)) if os.path.isdir(os.path.join(tables, name)) else []
        if "CURRENT" in entries:
            return 1
        for entry in entries:
            if entry.startswith("shard-") and "-of-" in entry and entry.rsplit("-of-", 1)[1].isdigit():
                return int(entry.rsplit("-of-", 1)[1])
    return None
