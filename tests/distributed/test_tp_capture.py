"""Tensor-parallel training capture on gloo == single-process capture (tiny Llama and Qwen3).

One 4-rank launch covers everything (process start-up dominates on 2 cores): TP=4 (mesh 1 x 4)
and TP=2 (mesh 2 x 2, two tp groups: the mesh's "tp" group is the decoder's tp group), for both
families. Checks: aux and last hidden states and target logits equal TP=1's; each rank holds and
READ only its shard; the tp group's union batch, scattered back, gives every rank exactly its own
sequences' states.
"""

import pytest
import torch
from safetensors import safe_open

from torchspec.distributed import build_mesh, gather_tp_batch, init_distributed, scatter_for_rank
from torchspec.targets import TargetDecoder, build_tiny_target, llama

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
    import torchspec.targets.loader as loader

    loader.safe_open = _CountingSafeOpen  # count what the loader reads
    info = init_distributed(device_type="cpu")
    results = {}
    for tp in TP_SIZES:
        mesh = build_mesh(info.world_size, tp, "cpu")
        tp_mesh = mesh["tp"]
        for flavour, path in target_dirs.items():
            _CountingSafeOpen.read_numel = 0
            target = TargetDecoder.from_pretrained(path, AUX_IDS, tp_group=tp_mesh.get_group())
            read_numel = _CountingSafeOpen.read_numel
            out = target.capture(*shared)
            attn = target.layers[0].self_attn
            # The tp group's union of its ranks' own micro-batches, one target forward, own slice back.
            own_ids, own_mask = own_batches[info.rank]
            union, layout = gather_tp_batch(
                {"input_ids": own_ids, "attention_mask": own_mask}, tp_mesh.get_group()
            )
            union_out = target.capture(union["input_ids"], union["attention_mask"])
            tp_rank = tp_mesh.get_local_rank()
            results[(tp, flavour)] = {
                "tp_rank": tp_rank,
                "decoder_tp": (target.tp_rank, target.tp_size),
                "aux": out.aux_hidden_states,
                "last": out.last_hidden_state,
                "logits": target.target_logits(out.last_hidden_state),
                "captured_types": {type(t) for t in [*out.aux_hidden_states, out.last_hidden_state]},
                "q_proj": attn.q_proj.weight.clone(),
                "o_proj": attn.o_proj.weight.clone(),
                "shapes": {name: tuple(p.shape) for name, p in target.named_parameters()},
                "local_numel": sum(p.numel() for p in target.parameters()),
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
    return {f: TargetDecoder.from_pretrained(p, AUX_IDS) for f, p in dirs.items()}


def _max_diff(a, b):
    return (a - b).abs().max().item()


def test_tp_plan_agrees_with_transformers():
    """Our colwise/rowwise plan is the one transformers ships for every family (a second opinion)."""
    from transformers import AutoConfig

    for model_type in llama.FAMILIES:
        plan = AutoConfig.for_model(model_type).base_model_tp_plan
        hf = {k: v for k, v in plan.items() if v in ("colwise", "rowwise")}
        assert {f"layers.*.{k}": v for k, v in llama.TP_PLAN.items()} == hf, model_type


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tp_capture_equals_single_process(setup, references, tp, flavour):
    _, shared, _, results = setup
    ref = references[flavour]
    want = ref.capture(*shared)
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
        assert got["decoder_tp"] == (r, tp)
        shapes = got["shapes"]
        assert shapes["layers.5.self_attn.k_proj.weight"] == (64 // tp, 64)  # colwise: 1/tp of the KV heads
        assert shapes["layers.5.mlp.up_proj.weight"] == (128 // tp, 64)
        assert shapes["layers.5.mlp.down_proj.weight"] == (64, 128 // tp)  # rowwise: 1/tp of the inputs
        assert shapes["embed_tokens.weight"] == (VOCAB, 64) and shapes["norm.weight"] == (64,)  # replicated
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
        want = ref.capture(*own[rank])
        for a, b in zip(got["own_aux"], want.aux_hidden_states):
            assert a.shape == b.shape
            assert _max_diff(a, b) <= ATOL, f"rank {rank} tp={tp}: {_max_diff(a, b)}"
        assert got["own_last"].shape == want.last_hidden_state.shape
        assert _max_diff(got["own_last"], want.last_hidden_state) <= ATOL
