"""`python -m cn_dlrm`: the `cn-dlrm` command (also under torchrun, one process per rank)."""
from cn_dlrm.cli import main

raise SystemExit(main())
