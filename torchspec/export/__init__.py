"""Exports: drafter -> serving directory (``serving``), tied to the target it was trained on."""

from torchspec.export.serving import (
    export_drafter,
    export_from_checkpoint,
    load_exported_drafter,
    target_identity,
    weights_fingerprint,
)

__all__ = ["export_drafter", "export_from_checkpoint", "load_exported_drafter", "target_identity",
           "weights_fingerprint"]
