from cncore_torch.dlrm.train import main

raise SystemExit(main())
