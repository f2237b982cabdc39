"""tools/drafter_parts.py: an export packed into parts and unpacked elsewhere is the same export, bit for bit;
the frozen embedding travels only when the target cannot give it back; every broken input is a one-line error
that writes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.runtime_pair import build_pair
from tests.tool_loader import load_tool
from torchspec.export.serving import load_exported_drafter
from torchspec.runtime.loading import decoder_identity
from torchspec.targets import TargetDecoder


@pytest.fixture(scope="module")
def tool():
    return load_tool("drafter_parts")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp("pair_parts"), tiny_tokenizer)


@pytest.fixture(scope="module")
def other_target(tmp_path_factory, tiny_tokenizer):
    """A target of the same shape with other weights (another embedding)."""
    return build_pair(tmp_path_factory.mktemp("pair_parts_other"), tiny_tokenizer, seed=7)[0]


def same_export(a: str, b: str) -> bool:
    wa, wb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    same_tensors = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) and wa[k].dtype == wb[k].dtype for k in wa)
    return same_tensors and json.load(open(f"{a}/config.json")) == json.load(open(f"{b}/config.json"))


def test_parts_spread_over_folders_unpack_to_the_same_export_with_the_embedding_from_the_target(tool, pair, tmp_path):
    target, export = pair
    tool.main(["pack", export, str(tmp_path / "packed"), "--target", target, "--part-mib", "0.02"])
    manifest = json.loads((tmp_path / "packed" / "drafter_parts.json").read_text())
    assert manifest["left_out"] == ["embed_tokens.weight"] and len(manifest["parts"]) >= 4
    assert all(p["bytes"] <= 0.02 * 2**20 for p in manifest["parts"])
    embedding = load_file(f"{export}/model.safetensors")["embed_tokens.weight"]
    original = (Path(export) / "model.safetensors").stat().st_size
    assert sum(p["bytes"] for p in manifest["parts"]) < original - embedding.numel() * embedding.element_size() + 1024
    # the parts of one call each: half in one folder, the rest and the manifest in another
    first, second = tmp_path / "call1", tmp_path / "call2"
    first.mkdir(), second.mkdir()
    for i, part in enumerate(sorted((tmp_path / "packed").glob("drafter.part*"))):
        shutil.copy(part, first if i % 2 == 0 else second)
    shutil.copy(tmp_path / "packed" / "drafter_parts.json", second)
    tool.main(["unpack", str(tmp_path / "back"), str(first), str(second), "--target", target])
    assert same_export(export, str(tmp_path / "back"))
    decoder = TargetDecoder.from_pretrained(target, aux_layer_ids=[1, 2, 3])
    load_exported_drafter(str(tmp_path / "back"), target=decoder_identity(decoder))  # strict load: every tensor


@pytest.mark.parametrize("with_target", [False, True])
def test_the_embedding_travels_unless_the_target_holds_the_same(tool, pair, other_target, tmp_path, with_target):
    _, export = pair
    tool.main(["pack", export, str(tmp_path / "packed"), *(["--target", other_target] if with_target else [])])
    assert json.loads((tmp_path / "packed" / "drafter_parts.json").read_text())["left_out"] == []
    tool.main(["unpack", str(tmp_path / "back"), str(tmp_path / "packed")])
    assert same_export(export, str(tmp_path / "back"))


def fails(tool, capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        tool.main(argv)
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert message in line and "\n" not in line, line


def test_broken_inputs_are_one_line_errors_that_write_nothing(tool, pair, other_target, tmp_path, capsys):
    target, export = pair
    packed = tmp_path / "packed"
    tool.main(["pack", export, str(packed), "--target", target, "--part-mib", "0.02"])
    back = tmp_path / "back"
    fails(tool, capsys, ["unpack", str(back), str(packed)], "give --target")  # the embedding was left out
    capsys.readouterr()  # the fixtures' progress bars
    fails(tool, capsys, ["unpack", str(back), str(packed), "--target", other_target],
          "tensor embed_tokens.weight differs from the packed one (the target's embedding is not the one packed")
    part = packed / "drafter.part001"
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    fails(tool, capsys, ["unpack", str(back), str(packed), "--target", target], f"{part}: corrupt")
    part.unlink()
    fails(tool, capsys, ["unpack", str(back), str(packed), "--target", target], "drafter.part001 is missing")
    fails(tool, capsys, ["unpack", str(back), str(tmp_path)], "no drafter_parts.json in")
    tool.main(["pack", export, str(tmp_path / "other_pack"), "--part-mib", "0.05"])  # another pack's manifest
    fails(tool, capsys, ["unpack", str(back), str(packed), str(tmp_path / "other_pack"), "--target", target],
          "describe different packs")
    fails(tool, capsys, ["pack", str(tmp_path), str(tmp_path / "p2")], "not a drafter export")
    assert not back.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".back.")]
    back.mkdir()
    fails(tool, capsys, ["unpack", str(back), str(packed), "--target", target], f"{back} exists")
