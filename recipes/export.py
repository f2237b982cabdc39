"""Export a trained drafter for serving, from a training run's checkpoint.

    torchspec-export outputs/default exports/default                  # latest checkpoint, bfloat16
    torchspec-export outputs/default exports/step100 --step 100 --dtype float32

A run writes its final drafter in this format itself (``RUN_DIR/drafter``); this is for another
step, dtype or layout, and for runs from before that. Reads ``RUN_DIR/config.yaml`` and
``RUN_DIR/checkpoints/step_N``, rebuilds the drafter with the target's frozen embedding (of the
target it reads only the embedding and lm_head tensors, never the model), and writes
``OUT_DIR/config.json`` + ``model.safetensors`` (format: ``torchspec.export.serving``). The run's
config.yaml and the output directory are checked before anything loads; user errors print one
line, ``torchspec-export: error: ...``, and exit 2 (``--debug``: the traceback).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from torchspec.cli import ArgumentParser, one_line, read_json, user_errors
from torchspec.export.checkpoint_export import export_from_checkpoint
from torchspec.export.eagle3_layouts import detect_layout, save_layout
from torchspec.export.serving import DTYPES, load_exported_drafter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="torchspec-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="output_dir of a torchspec-train run (holds config.yaml, checkpoints/)")
    parser.add_argument("out_dir", help="export directory to write (new, empty, or an older export)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: latest)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the floating weights")
    parser.add_argument("--layout", choices=("torchspec", "sglang", "vllm"), default="torchspec",
                        help="torchspec: the serving export (strict, target fingerprint); sglang / vllm: an EAGLE-3 "
                             "drafter in the SpecForge/SGLang or speculators/vLLM checkpoint layout")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """RUN_DIR's config.yaml (every failure naming the file), --step and OUT_DIR, before anything loads."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from torchspec.config import Config, validate_config

    run_dir, out_dir = Path(args.run_dir), Path(args.out_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} {'is a file' if run_dir.exists() else 'does not exist'}; pass the "
                         f"output_dir of a torchspec-train run.")
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"{config_file} is missing: pass the output_dir of a torchspec-train run.")
    try:
        validate_config(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config_file))))
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as err:  # syntax, schema or values: this file's
        raise ValueError(f"{config_file}: {one_line(err).rstrip('.')}; it is not a config torchspec-train wrote "
                         f"(or was edited): restore it from the run.") from err
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step={args.step} must be >= 0 (a checkpoint step; omit it for the latest).")
    if out_dir.resolve() == run_dir.resolve() or run_dir.resolve() in out_dir.resolve().parents:
        raise ValueError(f"{out_dir} is inside the run directory {run_dir}; export to a directory of its own.")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file; pass a new or empty directory, or an older export to replace.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not _is_older_export(out_dir, args.layout):
        raise ValueError(f"{out_dir} exists and is not a {args.layout} export; refusing to overwrite it. "
                         f"Choose a new or empty directory.")


def _is_older_export(path: Path, layout: str) -> bool:
    try:
        config = read_json(path / "config.json", "")
        return "torchspec_export_version" in config if layout == "torchspec" else detect_layout(config) == layout
    except ValueError:
        return False


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
    with user_errors("torchspec-export", args.debug):
        check_args(args)
        if args.layout == "torchspec":
            summary = export_from_checkpoint(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype)
        else:
            summary = export_engine_layout(args)
    target = summary["target"]
    print(f"exported step {summary['step']} of {args.run_dir} ({summary['checkpoint']}) to {summary['path']}")
    print(f"  {summary['num_tensors']} tensors, {summary['num_bytes'] / 2**20:.1f} MiB, {summary['dtype']}")
    print(f"  target: {target['model_type']}, vocab {target['vocab_size']}, hidden {target['hidden_size']}, "
          f"{target['num_hidden_layers']} layers, aux layers {target['aux_layer_ids']}, "
          f"fingerprint {target['fingerprint']}")


if __name__ == "__main__":
    main()
