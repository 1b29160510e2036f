"""The `cn-dlrm` job: TorchRec's DLRM trained on dynamic tables (`cn-dlrm`, `python -m cn_dlrm`).

An application of the library, outside it: it imports `cncore` and `cncore_torch`, and they
import nothing of it. Its modules, each importing only the ones listed before it:

- `options`: the options and their checks, and `InputError` (no torch, so `--help` answers at once)
- `cli`: the command: parse the options, then load `job` (torch and TorchRec) and run it
- `data`: the synthetic Criteo-like stream as torch batches, and the Criteo text file reader
- `bounded`: the row budgets, eviction and admission policies and SSD tier of the table options
- `chains`: incremental checkpoints as table file chains
- `train`: the run's parts: data, the model on dynamic tables, the training loop, checkpoints, the report
- `compare`: TorchRec's own tables on the same data (--compare)
- `distributed`: the run on several processes (`--nproc`, torchrun)
- `job`: `run(args)`: the run on one process, or `distributed`'s on several

Importing the package imports none of them.
"""
