"""The Ray layer: a thin adapter from Ray Train / Ray Data to the torch.distributed core."""
