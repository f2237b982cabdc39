"""Tensor-parallel target capture on gloo == single-process capture (tiny Llama and Qwen3).

One 4-rank launch covers everything (process start-up dominates on 2 cores): TP=4 (mesh 1 x 4)
and TP=2 (mesh 2 x 2, two tp groups), for both families. Checks: aux and last hidden states and
target logits equal the single-process ones; each rank holds and READ only its shard; the tp
group's union batch, scattered back, gives every rank exactly its own sequences' states.
"""

import pytest
import torch
from safetensors import safe_open

from torchspec.distributed import build_mesh, gather_tp_batch, init_distributed, scatter_for_rank
from torchspec.target import TargetModel, build_tiny_target
from torchspec.target.parallelize import TP_PLANS, load_tp_target, tp_plan_for

from .launcher import launch

FLAVOURS = ("llama", "qwen3")
TP_SIZES = (4, 2)
WORLD = 4
AUX_IDS = [0, 3, 7]  # first, middle and last decoder layer of 8
VOCAB = 384
ATOL = 1e-5


def _shared_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding in row 1
    return ids, mask


def _own_batches():
    """Per global rank, a micro-batch of its own shape: the tp group must pad, gather and scatter."""
    g = torch.Generator().manual_seed(1)
    shapes = [(1, 7), (2, 9), (2, 6), (1, 9)]
    batches = []
    for b, t in shapes:
        ids = torch.randint(0, VOCAB, (b, t), generator=g)
        mask = torch.ones(b, t, dtype=torch.long)
        if b == 2:
            mask[1, t - 3 :] = 0
        batches.append((ids, mask))
    return batches


class _CountingSafeOpen:
    """safe_open whose slices record how many elements each read materialises."""

    read_numel = 0

    def __init__(self, *args, **kwargs):
        self._f = safe_open(*args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_slice(self, key):
        stored = self._f.get_slice(key)

        class _Slice:
            def get_shape(self):
                return stored.get_shape()

            def __getitem__(self, index):
                t = stored[index]
                _CountingSafeOpen.read_numel += t.numel()
                return t

        return _Slice()


def _tp_worker(target_dirs, shared, own_batches):
    from torch.distributed.tensor import DTensor

    import torchspec.target.parallelize as parallelize

    parallelize.safe_open = _CountingSafeOpen  # count what the loader reads
    info = init_distributed(device_type="cpu")
    results = {}
    for tp in TP_SIZES:
        mesh = build_mesh(info.world_size, tp, "cpu")
        tp_mesh = mesh["tp"]
        for flavour, path in target_dirs.items():
            _CountingSafeOpen.read_numel = 0
            target = load_tp_target(path, tp_mesh, AUX_IDS)
            read_numel = _CountingSafeOpen.read_numel
            out = target(*shared)
            attn = target.decoder.layers[0].self_attn
            # The tp group's union of its ranks' own micro-batches, one target forward, own slice back.
            own_ids, own_mask = own_batches[info.rank]
            union, layout = gather_tp_batch(
                {"input_ids": own_ids, "attention_mask": own_mask}, tp_mesh.get_group()
            )
            union_out = target(union["input_ids"], union["attention_mask"])
            tp_rank = tp_mesh.get_local_rank()
            params = {id(p): p for p in target.parameters()}.values()  # tied weights once
            results[(tp, flavour)] = {
                "tp_rank": tp_rank,
                "aux": out.aux_hidden_states,
                "last": out.last_hidden_state,
                "logits": target.target_logits(out.last_hidden_state),
                "captured_types": {type(t) for t in [*out.aux_hidden_states, out.last_hidden_state]},
                "q_proj": attn.q_proj.weight.to_local().clone(),
                "o_proj": attn.o_proj.weight.to_local().clone(),
                "placements": {
                    name: str(p.placements)
                    for name, p in target.hf_model.named_parameters()
                    if isinstance(p, DTensor)
                },
                "local_numel": sum(
                    p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params
                ),
                "read_numel": read_numel,
                "own_aux": [scatter_for_rank(a, layout, tp_rank) for a in union_out.aux_hidden_states],
                "own_last": scatter_for_rank(union_out.last_hidden_state, layout, tp_rank),
            }
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    dirs = {
        f: build_tiny_target(
            str(tmp_path_factory.mktemp(f"tp_{f}")),
            f,
            vocab_size=VOCAB,
            num_layers=8,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=4,
        )
        for f in FLAVOURS
    }
    shared, own = _shared_inputs(), _own_batches()
    results = launch(_tp_worker, world_size=WORLD, args=(dirs, shared, own), timeout_s=240)
    return dirs, shared, own, results


@pytest.fixture(scope="module")
def references(setup):
    dirs = setup[0]
    return {f: TargetModel.from_pretrained(p, AUX_IDS) for f, p in dirs.items()}


def _max_diff(a, b):
    return (a - b).abs().max().item()


def test_tp_plans_agree_with_transformers():
    """Our colwise/rowwise plan is the one transformers ships for the family (a second opinion)."""
    from transformers import LlamaConfig, Qwen3Config

    for family, cfg in [("llama", LlamaConfig()), ("qwen3", Qwen3Config())]:
        hf = {k: v for k, v in cfg.base_model_tp_plan.items() if v in ("colwise", "rowwise")}
        assert TP_PLANS[family] == hf
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*known: \['llama', 'qwen3'\]"):
        from transformers import GPT2Config

        tp_plan_for(GPT2Config())


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tp_capture_equals_single_process(setup, references, tp, flavour):
    _, shared, _, results = setup
    ref = references[flavour]
    want = ref(*shared)
    want_logits = ref.target_logits(want.last_hidden_state)
    for rank, per_rank in enumerate(results):
        got = per_rank[(tp, flavour)]
        assert got["captured_types"] == {torch.Tensor}, (
            "captured states must be plain full tensors, not DTensors"
        )
        for j, (a, b) in enumerate(zip(got["aux"], want.aux_hidden_states)):
            assert a.shape == b.shape == (2, 12, 64)
            assert _max_diff(a, b) <= ATOL, f"rank {rank} tp={tp} aux {AUX_IDS[j]}: {_max_diff(a, b)}"
        assert _max_diff(got["last"], want.last_hidden_state) <= ATOL, f"rank {rank} tp={tp} last hidden"
        assert got["logits"].shape == (2, 12, VOCAB)
        assert _max_diff(got["logits"], want_logits) <= ATOL, f"rank {rank} tp={tp} logits"


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_each_rank_holds_and_reads_only_its_shard(setup, tp, flavour):
    dirs, _, _, results = setup
    with safe_open(f"{dirs[flavour]}/model.safetensors", framework="pt") as f:
        q_full = f.get_tensor("model.layers.0.self_attn.q_proj.weight")  # [4 heads * 16, 64]
        o_full = f.get_tensor("model.layers.0.self_attn.o_proj.weight")  # [64, 64]
        full_numel = sum(f.get_tensor(k).numel() for k in f.keys())
        replicated_numel = sum(
            f.get_tensor(k).numel()
            for k in f.keys()
            if not any(s in k for s in ("_proj.weight", "_proj.bias"))
        )
    rows = q_full.shape[0] // tp
    for per_rank in results:
        got = per_rank[(tp, flavour)]
        r = got["tp_rank"]
        assert got["q_proj"].shape == (rows, 64)  # 1/tp of the heads
        assert torch.equal(got["q_proj"], q_full[r * rows : (r + 1) * rows])
        assert torch.equal(got["o_proj"], o_full[:, r * rows : (r + 1) * rows])
        placements = got["placements"]
        assert placements["model.layers.5.self_attn.k_proj.weight"] == "(Shard(dim=0),)"
        assert placements["model.layers.5.mlp.up_proj.weight"] == "(Shard(dim=0),)"
        assert placements["model.layers.5.mlp.down_proj.weight"] == "(Shard(dim=1),)"
        assert not any("embed" in n or "norm" in n for n in placements)  # replicated stay plain
        # Held == read == the replicated weights whole + 1/tp of every projection; never the full model.
        expected = replicated_numel + (full_numel - replicated_numel) // tp
        assert got["local_numel"] == expected
        assert got["read_numel"] == expected < full_numel


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_union_batch_scattered_back_matches_own_batch(setup, references, tp, flavour):
    _, _, own, results = setup
    ref = references[flavour]
    for rank, per_rank in enumerate(results):
        got = per_rank[(tp, flavour)]
        want = ref(*own[rank])
        for a, b in zip(got["own_aux"], want.aux_hidden_states):
            assert a.shape == b.shape
            assert _max_diff(a, b) <= ATOL, f"rank {rank} tp={tp}: {_max_diff(a, b)}"
        assert got["own_last"].shape == want.last_hidden_state.shape
        assert _max_diff(got["own_last"], want.last_hidden_state) <= ATOL
