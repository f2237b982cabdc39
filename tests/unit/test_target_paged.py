"""The target decoder's serving forward (PagedAttend over the paged KV cache) against transformers.

Parity in fp32 (1e-4 abs on logits): batched prefill with rows of different lengths and an
invalid (padding) row; incremental decode with per-row context lengths; a tree-masked forward
vs the plain causal forward of each node's root-to-node path. The paged forward's captured
states, last hidden and logits equal the training capture's (same module, only the attend
differs) for every tiny family.
Variants cover every supported RoPE type, untied head, attention/MLP biases (randomised, HF
initialises them to zero), Qwen2's q/k/v bias, and a sharded checkpoint. Pages are handed out
non-contiguously (page_size 4) so every sequence spans several scattered pages.
"""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from torchspec.runtime.paged_kv import PageAllocator, PagedAttend, PagedKVCache, build_attention_meta
from torchspec.runtime.tree import tree_attention_mask
from torchspec.targets import TINY_FLAVOURS, TargetDecoder, build_tiny_target, family_of
from torchspec.targets.rope import RopeTables


def decoder_args(config, tp_size: int = 1):
    return family_of(config).decoder_args(config, tp_size)

VOCAB = 384
PAGE = 4
PAGES_PER_ROW = 5  # 20 positions per row
ATOL = 1e-4
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
ROPES = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
VARIANTS = {  # name -> (config class, model class, config kwargs, save kwargs)
    **{f"rope_{k}": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": v}, {}) for k, v in ROPES.items()},
    "untied_sharded": (
        LlamaConfig,
        LlamaForCausalLM,
        {"tie_word_embeddings": False},
        {"max_shard_size": "60KB"},
    ),
    "llama_bias": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}, {}),
    "qwen2_bias": (Qwen2Config, Qwen2ForCausalLM, {}, {}),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny matmuls gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    # spin-waiting makes each one ~100x slower; restore the setting for the other modules.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build_variant(out: str, name: str) -> str:
    config_cls, model_cls, kwargs, save_kwargs = VARIANTS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config_cls(**SMALL, **kwargs))
        for p in model.parameters():  # norms start at 1 and biases at 0: perturb them
            if p.ndim == 1:
                p.data.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out, **save_kwargs)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen3", *VARIANTS])
def case(request, tmp_path_factory, tiny_tokenizer):
    out = str(tmp_path_factory.mktemp(request.param))
    if request.param in ("llama", "qwen3"):
        path = build_tiny_target(out, flavour=request.param, vocab_size=VOCAB, tokenizer=tiny_tokenizer)
    else:
        path = _build_variant(out, request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf, TargetDecoder.from_pretrained(path, aux_layer_ids=())


def _block_tables(batch: int, num_pages: int = 32) -> torch.Tensor:
    """Scattered pages: row b gets every batch-th page of a shuffled allocation."""
    pages = PageAllocator(num_pages).alloc(batch * PAGES_PER_ROW)
    perm = torch.randperm(len(pages), generator=torch.Generator().manual_seed(1))
    return torch.tensor(pages)[perm].view(PAGES_PER_ROW, batch).T.contiguous()  # [B, P]


def _forward(dec, cache, bt, ids, ctx_len, tree_mask=None, positions=None, row_valid=None):
    b, t = ids.shape
    if tree_mask is None:
        tree_mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    if positions is None:
        positions = ctx_len[:, None] + torch.arange(t)
    meta = build_attention_meta(bt, ctx_len, tree_mask, PAGE, row_valid=row_valid)
    return dec.logits(dec(ids, positions, PagedAttend(cache, meta)).hidden)


@torch.no_grad()
def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0]


def _ids(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_prefill_matches_transformers(case):
    name, _, hf, dec = case
    ids = _ids(3, 13)
    lengths = [13, 8]  # row 1 is right-padded; row 2 is an invalid row writing to the trash page
    bt = _block_tables(3)
    bt[2] = 0
    cache = PagedKVCache.for_target(dec, 32, PAGE)
    got = _forward(
        dec, cache, bt, ids, torch.zeros(3, dtype=torch.long), row_valid=torch.tensor([True, True, False])
    )
    assert got.dtype == torch.float32 and got.shape == (3, 13, VOCAB)
    for row, n in enumerate(lengths):
        want = _hf_logits(hf, ids[row, :n])
        diff = (got[row, :n] - want).abs().max().item()
        assert diff <= ATOL, f"{name} row {row}: {diff}"


def test_incremental_decode_matches_full_forward(case):
    name, _, hf, dec = case
    ids = _ids(2, 12, seed=1)
    prompt = torch.tensor([5, 3])  # row 1's prefill is padded from 3 to 5 tokens
    bt, cache = _block_tables(2), PagedKVCache.for_target(dec, 32, PAGE)
    _forward(dec, cache, bt, ids[:, :5], torch.zeros(2, dtype=torch.long))
    full = [_hf_logits(hf, ids[0]), _hf_logits(hf, ids[1])]
    for step in range(7):
        ctx = prompt + step
        got = _forward(dec, cache, bt, ids.gather(1, ctx[:, None]), ctx)  # [2, 1, V]
        for row in range(2):
            diff = (got[row, 0] - full[row][ctx[row]]).abs().max().item()
            assert diff <= ATOL, f"{name} row {row} step {step}: {diff}"


def test_tree_forward_matches_each_path(case):
    name, _, hf, dec = case
    # Root 0 (last committed token) with two branches: 0 -> 1 -> 3 -> 5 and 0 -> 2 -> 4.
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]]).expand(2, 6)
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    ctx = torch.tensor([6, 4])
    prefix, nodes = _ids(2, 6, seed=2), _ids(2, 6, seed=3)
    bt, cache = _block_tables(2), PagedKVCache.for_target(dec, 32, PAGE)
    _forward(dec, cache, bt, prefix, torch.zeros(2, dtype=torch.long))
    got = _forward(
        dec, cache, bt, nodes, ctx, tree_mask=tree_attention_mask(parents), positions=ctx[:, None] + depths
    )
    for row in range(2):
        for node in range(6):
            path, i = [], node
            while i >= 0:
                path.insert(0, int(nodes[row, i]))
                i = int(parents[row, i])
            seq = torch.cat([prefix[row, : ctx[row]], torch.tensor(path)])
            diff = (got[row, node] - _hf_logits(hf, seq)[-1]).abs().max().item()
            assert diff <= ATOL, f"{name} row {row} node {node}: {diff}"


@pytest.fixture(scope="module", params=sorted(TINY_FLAVOURS))
def family_dir(request, tmp_path_factory):
    return build_tiny_target(str(tmp_path_factory.mktemp(f"fam_{request.param}")), request.param,
                             vocab_size=VOCAB, num_kv_heads=2)


def test_paged_forward_equals_capture_forward(family_dir):
    """Same module, two attends: the serving forward over the paged cache == training capture (fp32)."""
    aux_ids = (1, 3, 4)
    dec = TargetDecoder.from_pretrained(family_dir, aux_layer_ids=list(aux_ids))
    ids = _ids(2, 9, seed=4)
    want = dec.capture(ids)
    cache = PagedKVCache.for_target(dec, 32, PAGE)
    meta = build_attention_meta(
        _block_tables(2),
        torch.zeros(2, dtype=torch.long),
        torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 9, 9),
        PAGE,
    )
    out = dec(ids, torch.arange(9).expand(2, 9), PagedAttend(cache, meta), capture_layers=aux_ids)
    assert len(out.aux) == 3
    for j, (a, b) in enumerate(zip(out.aux, want.aux_hidden_states)):
        assert a.shape == b.shape == (2, 9, 64)
        assert (a - b).abs().max().item() <= 1e-5, f"aux {aux_ids[j]}"
    assert (out.hidden - want.last_hidden_state).abs().max().item() <= 1e-5
    assert (dec.logits(out.hidden) - dec.target_logits(want.last_hidden_state)).abs().max().item() <= 1e-5
    # aux id L-1 is the pre-norm residual (not HF's last hidden_states entry): capture's convention too.
    last = dec(ids, torch.arange(9).expand(2, 9), PagedAttend(cache, meta), capture_layers=(7,))
    assert not torch.allclose(last.aux[0], out.hidden)
    with pytest.raises(ValueError, match=r"capture_layers \[8\] outside \[0, 7\]"):
        dec(ids, torch.arange(9).expand(2, 9), PagedAttend(cache, meta), capture_layers=(8,))


def test_properties_and_cache(tiny_target_dir, tiny_tokenizer):
    dec = TargetDecoder.from_pretrained(tiny_target_dir, aux_layer_ids=())
    assert (dec.num_layers, dec.hidden_size, dec.vocab_size, dec.head_dim, dec.num_kv_heads_local) == (
        8,
        64,
        VOCAB,
        16,
        4,
    )
    assert dec.eos_token_ids == (tiny_tokenizer.eos_token_id,)
    assert dec.lm_head_weight is dec.embed_tokens_weight  # tied
    assert dec.config.model_type in ("llama", "qwen3")
    cache = PagedKVCache.for_target(dec, 6, PAGE, dtype=torch.bfloat16)
    assert cache.k.shape == (8, 6 * PAGE, 4, 16) and cache.k.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in dec.parameters())


@pytest.mark.parametrize("rope", [None, *ROPES, "old_style"])
def test_rope_tables_equal_transformers(rope):
    config = LlamaConfig(**SMALL, rope_scaling=ROPES.get(rope), rope_theta=50000.0)
    hf = LlamaRotaryEmbedding(config)
    if rope == "old_style":  # pre-transformers-5 attributes: rope_theta + rope_scaling with "type"
        config = LlamaConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 3.0}, rope_theta=50000.0)
        hf = LlamaRotaryEmbedding(config)
        config = SimpleNamespace(**SMALL, rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 3.0})
    ours = RopeTables.from_config(config)
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    assert ours.attention_scaling == hf.attention_scaling
    assert (ours.attention_scaling != 1.0) == (rope == "yarn")
    positions = torch.arange(60).view(2, 5, 6)  # any shape, all < max_position_embeddings (dynamic)
    cos, sin = ours(positions)
    want_cos, want_sin = hf(torch.zeros(1), positions.view(1, -1))
    assert cos.shape == (2, 5, 6, 16)
    assert torch.equal(cos.view(1, 60, 16), want_cos) and torch.equal(sin.view(1, 60, 16), want_sin)


def test_unsupported_configs_are_refused(tmp_path, tiny_llama_dir):
    with pytest.raises(
        ValueError, match=r"model_type='gpt2' is not supported.*\['llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_5_text', 'qwen3_next'\]"
    ):
        decoder_args(GPT2Config())
    with pytest.raises(
        ValueError, match=r"tensor-parallel size 3 .*num_attention_heads=4.*Supported tp sizes: \[1, 2, 4\]"
    ):
        decoder_args(LlamaConfig(**{**SMALL, "num_key_value_heads": 4, "intermediate_size": 128}), tp_size=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 not divisible by 4"):
        decoder_args(LlamaConfig(**SMALL), tp_size=4)
    with pytest.raises(ValueError, match=r"sliding_window=4096"):
        decoder_args(MistralConfig(**SMALL, sliding_window=4096))
    decoder_args(MistralConfig(**SMALL, sliding_window=None))
    with pytest.raises(ValueError, match=r"rope_type='longrope'.*supported: \['default', 'dynamic'"):
        RopeTables.from_config(
            LlamaConfig(
                **SMALL,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
            )
        )
    with pytest.raises(ValueError, match=r"hidden_act='gelu'"):
        decoder_args(LlamaConfig(**SMALL, hidden_act="gelu"))
    # config.json promising biases the checkpoint lacks: refused before any forward.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match=r"lacks 32 weights: .*q_proj.bias"):
        TargetDecoder.from_pretrained(str(broken), aux_layer_ids=())
