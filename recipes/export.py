"""Export a trained drafter for serving, from a training run's checkpoint.

    torchspec-export outputs/default exports/default                  # latest checkpoint, bfloat16
    torchspec-export outputs/default exports/step100 --step 100 --dtype float32

Reads ``RUN_DIR/config.yaml`` and ``RUN_DIR/checkpoints/step_N``, rebuilds the drafter with the
target's frozen embedding, and writes ``OUT_DIR/config.json`` + ``model.safetensors`` (format:
``torchspec.export.serving``). User errors print ``torchspec-export: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from torchspec.export.eagle3_layouts import save_layout
from torchspec.export.serving import DTYPES, export_from_checkpoint, load_exported_drafter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchspec-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="output_dir of a torchspec-train run (holds config.yaml, checkpoints/)")
    parser.add_argument("out_dir", help="export directory to write (new, empty, or an older export)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: latest)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the floating weights")
    parser.add_argument("--layout", choices=("torchspec", "sglang", "vllm"), default="torchspec",
                        help="torchspec: the serving export (strict, target fingerprint); sglang / vllm: an EAGLE-3 "
                             "drafter in the SpecForge/SGLang or speculators/vLLM checkpoint layout")
    return parser.parse_args(argv)


def export_engine_layout(args: argparse.Namespace) -> dict:
    """The serving export first (all checks), then the EAGLE-3 adapter for SGLang or vLLM."""
    with tempfile.TemporaryDirectory(dir=Path(args.out_dir).resolve().parent) as tmp:
        summary = export_from_checkpoint(args.run_dir, Path(tmp) / "export", step=args.step, dtype=args.dtype)
        drafter = load_exported_drafter(Path(tmp) / "export")
        if drafter.config.model_type != "torchspec_eagle3":
            raise ValueError(f"--layout {args.layout} writes EAGLE-3 drafters; {args.run_dir} trained a "
                             f"{drafter.config.model_type}. Use --layout torchspec.")
        save_layout(drafter, args.out_dir, layout=args.layout)
    return {**summary, "path": str(args.out_dir)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.layout == "torchspec":
            summary = export_from_checkpoint(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype)
        else:
            summary = export_engine_layout(args)
    except ValueError as err:
        print(f"torchspec-export: error: {err}", file=sys.stderr)
        sys.exit(2)
    target = summary["target"]
    print(f"exported step {summary['step']} of {args.run_dir} ({summary['checkpoint']}) to {summary['path']}")
    print(f"  {summary['num_tensors']} tensors, {summary['num_bytes'] / 2**20:.1f} MiB, {summary['dtype']}")
    print(f"  target: {target['model_type']}, vocab {target['vocab_size']}, hidden {target['hidden_size']}, "
          f"{target['num_hidden_layers']} layers, aux layers {target['aux_layer_ids']}, "
          f"fingerprint {target['fingerprint']}")


if __name__ == "__main__":
    main()
