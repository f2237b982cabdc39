"""Hydra config groups shipped inside the package (``pkg://torchspec.conf``)."""
