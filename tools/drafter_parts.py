"""Move a drafter export through size-limited channels and back, verified bit for bit.

The GPU machine returns at most 8 files of 16 MiB (64 MiB) a call and takes 64 MiB a call, and keeps nothing
between leases, so a drafter trained there (SmolLM2's EAGLE-4 export is ~136 MB in bf16) is lost unless it
travels in parts: trained once, served again in later sessions without retraining.

    python tools/drafter_parts.py pack EXPORT OUT_DIR [--target T --cache-dir C] [--part-mib 16]
    python tools/drafter_parts.py unpack NEW_EXPORT PARTS_DIR [PARTS_DIR ...] [--target T --cache-dir C]

``pack`` writes ``drafter_parts.json`` and the parts ``drafter.part000``, ``drafter.part001``, ... of at most
``--part-mib`` MiB: the bytes of one safetensors file holding the export's tensors. The manifest records every
part's size and sha256, every tensor's dtype, shape and sha256, and the export's other (small) files. With
``--target``, the frozen embedding (``embed_tokens.weight``, V x H: 57 MB of SmolLM2's export) is left out when it
equals the target's embedding in the export's dtype bit for bit; ``unpack`` then takes it from the same target.

``unpack`` reads the manifest and the parts from the given folders (spread over them in any way, e.g. one
folder a carried call), checks every part's and every tensor's hash, and writes the export into a temporary
folder renamed to ``NEW_EXPORT`` at the end. A missing or corrupt part, a missing target for a left-out
embedding, a target whose embedding differs, or an existing ``NEW_EXPORT`` is a one-line error (exit 2) naming
it; nothing is written then.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchspec.cli import user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402

MANIFEST = "drafter_parts.json"
WEIGHTS = "model.safetensors"
EMBEDDING = "embed_tokens.weight"
FORMAT = "torchspec-drafter-parts"


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def target_embedding(target: str, cache_dir: str, config: dict) -> torch.Tensor:
    """The target's [V, H] embedding in the export's dtype (a .gguf target is converted once into ``cache_dir``)."""
    from torchspec.export.serving import read_target_embeddings
    from torchspec.targets.loader import resolve_target_path

    path = resolve_target_path(target, os.path.expanduser(cache_dir))
    dtype = getattr(torch, config.get("dtype", "float32"))
    return read_target_embeddings(path, config["aux_layer_ids"], dtype).embed_tokens_weight


def pack(export: Path, out: Path, part_bytes: int, target: str | None = None, cache_dir: str = "~/.cache/torchspec") -> dict:
    """``export`` -> ``out``/manifest + parts (module docstring); returns the manifest."""
    if not (export / WEIGHTS).is_file() or not (export / "config.json").is_file():
        raise ValueError(f"{export}: not a drafter export (no {WEIGHTS} and config.json); give the folder "
                         f"torchspec-export wrote")
    config = json.loads((export / "config.json").read_text())
    tensors = load_file(str(export / WEIGHTS))
    record = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}
              for name, t in tensors.items()}
    dropped = []
    if target is not None and EMBEDDING in tensors and torch.equal(target_embedding(target, cache_dir, config),
                                                                   tensors[EMBEDDING]):
        dropped.append(EMBEDDING)
        del tensors[EMBEDDING]
    payload = save(tensors)
    others = {p.name: base64.b64encode(p.read_bytes()).decode() for p in sorted(export.iterdir())
              if p.is_file() and p.name != WEIGHTS}
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # an earlier pack's manifest must not vouch for this pack's parts
    parts = []
    for i, start in enumerate(range(0, len(payload), part_bytes)):
        chunk = payload[start:start + part_bytes]
        name = f"drafter.part{i:03d}"
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(chunk)
        os.replace(tmp, out / name)
        parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"format": FORMAT, "version": 1, "source": str(export), "parts": parts, "tensors": record,
                "left_out": dropped, "files": others}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def find_parts(folders: list[Path]) -> tuple[dict, dict[str, Path]]:
    """The manifest and {part name: path} over ``folders``."""
    manifests = [f / MANIFEST for f in folders if (f / MANIFEST).is_file()]
    if not manifests:
        raise ValueError(f"no {MANIFEST} in {[str(f) for f in folders]}: give the folders `pack` wrote into")
    manifest = json.loads(manifests[0].read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifests[0]}: not a {FORMAT} manifest")
    for other in manifests[1:]:  # every call of a fetch brings the manifest: they must be one pack's
        if json.loads(other.read_text()) != manifest:
            raise ValueError(f"{other} and {manifests[0]} describe different packs: give the parts of one pack")
    found = {p.name: p for f in folders for p in f.glob("drafter.part*") if not p.name.startswith(".")}
    return manifest, found


def unpack(new_export: Path, folders: list[Path], target: str | None = None, cache_dir: str = "~/.cache/torchspec") -> Path:
    """Parts in ``folders`` -> the export ``new_export`` (module docstring)."""
    if new_export.exists():
        raise ValueError(f"{new_export} exists: remove it or give another NEW_EXPORT")
    manifest, found = find_parts(folders)
    chunks = []
    for part in manifest["parts"]:
        path = found.get(part["name"])
        if path is None:
            raise ValueError(f"{part['name']} is missing from {[str(f) for f in folders]}: bring every part `pack` wrote")
        data = path.read_bytes()
        if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
            raise ValueError(f"{path}: corrupt ({len(data)} bytes, sha256 differs from the manifest's); copy it again")
        chunks.append(data)
    tensors = load(b"".join(chunks))
    config = json.loads(base64.b64decode(manifest["files"]["config.json"]))
    for name in manifest["left_out"]:
        if target is None:
            raise ValueError(f"{name} was left out (it is the target's): give --target (and --cache-dir) to restore it")
        tensors[name] = target_embedding(target, cache_dir, config)
    for name, want in manifest["tensors"].items():
        t = tensors.get(name)
        if t is None or tensor_sha256(t) != want["sha256"] or list(t.shape) != want["shape"]:
            what = "missing" if t is None else "differs from the packed one"
            hint = " (the target's embedding is not the one packed: give the same target)" if name in manifest["left_out"] else ""
            raise ValueError(f"tensor {name} {what}{hint}")
    new_export.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{new_export.name}.", dir=new_export.parent))
    try:
        for name, b64 in manifest["files"].items():
            (tmp / name).write_bytes(base64.b64decode(b64))
        save_file({n: tensors[n] for n in manifest["tensors"]}, str(tmp / WEIGHTS), metadata={"format": "pt"})
        os.replace(tmp, new_export)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return new_export


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="drafter_parts", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    a = sub.add_parser("pack", help="an export -> parts + manifest")
    a.add_argument("export", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--part-mib", type=float, default=16.0, help="largest part, MiB (default 16: $OUT's file limit)")
    b = sub.add_parser("unpack", help="parts + manifest -> an export")
    b.add_argument("new_export", type=Path)
    b.add_argument("folders", type=Path, nargs="+")
    for q in (a, b):
        q.add_argument("--target", default=None, help="the target (dir, .gguf or alias): its embedding is not packed")
        q.add_argument("--cache-dir", default="~/.cache/torchspec", help="where a .gguf target is converted once")
        q.add_argument("--debug", action="store_true", help="a traceback instead of the one-line error")
    args = p.parse_args(argv)
    with user_errors("drafter_parts", args.debug):
        if args.verb == "pack":
            if args.part_mib <= 0:
                raise ValueError(f"--part-mib={args.part_mib} must be > 0")
            m = pack(args.export, args.out, int(args.part_mib * 2**20), args.target, args.cache_dir)
            total = sum(x["bytes"] for x in m["parts"])
            print(f"{args.export} -> {args.out}: {len(m['parts'])} parts, {total / 2**20:.1f} MiB"
                  + (f" ({', '.join(m['left_out'])} left out: the target's)" if m["left_out"] else ""))
        else:
            print(f"unpacked {unpack(args.new_export, args.folders, args.target, args.cache_dir)}")


if __name__ == "__main__":
    main()
