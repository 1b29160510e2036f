"""The main job: TorchRec's DLRM trained on dynamic tables (`cn-dlrm`, `python -m cncore_torch.dlrm`)."""
