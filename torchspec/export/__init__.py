"""Exports: drafter -> serving directory (``serving``), tied to the target it was trained on; from any
step of a training run (``checkpoint_export``)."""

from torchspec.export.checkpoint_export import export_from_checkpoint
from torchspec.export.serving import (
    export_drafter,
    load_exported_drafter,
    target_identity,
    weights_fingerprint,
)

__all__ = ["export_drafter", "export_from_checkpoint", "load_exported_drafter", "target_identity",
           "weights_fingerprint"]
