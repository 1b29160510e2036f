"""The `cn-dlrm` command's launcher: its options, their checks, and what to install.

It imports no deep learning framework, so `cn-dlrm --help` and mistakes in options answer at
once, and a missing PyTorch or TorchRec is named with its install line instead of a traceback.
(It lives outside `cncore_torch` because importing that package imports torch.) The job itself
is `cncore_torch.dlrm.train`.
"""
