import sys

from cncore_torch.serving.cli import main

sys.exit(main())
