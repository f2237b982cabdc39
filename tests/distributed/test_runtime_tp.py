"""Tensor-parallel serving forward of the target decoder on gloo == the single-process one (TP=2 and TP=4).

One 4-rank launch covers everything (process start-up dominates on 2 cores): the whole world as
one TP=4 group, then two TP=2 groups ({0, 1}, {2, 3}). Targets: tiny Llama and Qwen3 (4 query
heads, 4 KV heads), and a GQA Llama (8 heads, 4 KV heads) with randomised attention and MLP biases
(a row-parallel bias must be added once, after the all-reduce). Checks: prefill logits and one
decode step's logits equal TP=1's within 1e-5 (fp32); each rank's q_proj / o_proj are exactly its
1/tp rows / columns of the checkpoint's, and its KV cache holds kv_heads/tp heads.
"""

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from torchspec.distributed import init_distributed
from torchspec.runtime.paged_kv import PagedAttend, PagedKVCache, build_attention_meta
from torchspec.targets import TargetDecoder, build_tiny_target

from .launcher import launch

WORLD = 4
TP_SIZES = (4, 2)
VOCAB = 384
PAGE = 4
ATOL = 1e-5


def _build_gqa_bias(out: str) -> str:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        for p in model.parameters():
            if p.ndim == 1:  # biases start at 0 and norms at 1: perturb them
                p.data.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def prefill_and_decode(dec: TargetDecoder) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill 2 rows (lengths 7 and 5, scattered pages), then decode one token per row."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    bt = torch.tensor([[5, 2, 7], [1, 6, 3]])
    cache = PagedKVCache.for_target(dec, 8, PAGE)
    causal = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 7, 7)
    zero = torch.zeros(2, dtype=torch.long)
    meta = build_attention_meta(bt, zero, causal, PAGE)
    prefill = dec.logits(dec(ids[:, :7], torch.arange(7).expand(2, 7), PagedAttend(cache, meta)).hidden)
    ctx = torch.tensor([7, 5])
    meta = build_attention_meta(bt, ctx, torch.ones(2, 1, 1, dtype=torch.bool), PAGE)
    decode = dec.logits(dec(ids.gather(1, ctx[:, None]), ctx[:, None], PagedAttend(cache, meta)).hidden)
    return prefill, decode


def _tp_worker(target_dirs: dict[str, str]):
    info = init_distributed(device_type="cpu")
    groups = {4: dist.new_group(list(range(WORLD)))}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    groups[2] = pairs[info.rank // 2]
    results = {}
    for tp in TP_SIZES:
        for name, path in target_dirs.items():
            dec = TargetDecoder.from_pretrained(path, aux_layer_ids=(), tp_group=groups[tp])
            prefill, decode = prefill_and_decode(dec)
            attn = dec.layers[0].self_attn
            results[(tp, name)] = {
                "tp_rank": dec.tp_rank,
                "prefill": prefill,
                "decode": decode,
                "q_proj": attn.q_proj.weight.clone(),
                "o_proj": attn.o_proj.weight.clone(),
                "kv_heads": PagedKVCache.for_target(dec, 2, PAGE).num_kv_heads,
            }
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    dirs = {
        f: build_tiny_target(str(tmp_path_factory.mktemp(f"rt_{f}")), f, vocab_size=VOCAB)
        for f in ("llama", "qwen3")
    }
    dirs["gqa_bias"] = _build_gqa_bias(str(tmp_path_factory.mktemp("rt_gqa_bias")))
    results = launch(_tp_worker, world_size=WORLD, args=(dirs,), timeout_s=240)
    return dirs, results


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gqa_bias"])
def test_tp_logits_equal_single_process(setup, tp, name):
    dirs, results = setup
    ref = TargetDecoder.from_pretrained(dirs[name], aux_layer_ids=())
    want_prefill, want_decode = prefill_and_decode(ref)
    with safe_open(f"{dirs[name]}/model.safetensors", framework="pt") as f:
        q_full = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        o_full = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    rows = q_full.shape[0] // tp
    for rank, per_rank in enumerate(results):
        got = per_rank[(tp, name)]
        r = got["tp_rank"]
        assert r == rank % tp
        for key, want in (("prefill", want_prefill), ("decode", want_decode)):
            diff = (got[key] - want).abs().max().item()
            assert got[key].shape == want.shape and diff <= ATOL, f"rank {rank} tp={tp} {key}: {diff}"
        assert got["q_proj"].shape == (rows, 64)
        assert torch.equal(got["q_proj"], q_full[r * rows : (r + 1) * rows])
        assert torch.equal(got["o_proj"], o_full[:, r * rows : (r + 1) * rows])
        assert got["kv_heads"] == ref.num_kv_heads_local // tp == 4 // tp
