"""Hybrid Gated-DeltaNet targets (qwen3_next, qwen3_5) in the target decoder == transformers, fp32 on CPU.

Tiny random targets (`build_tiny_target`: real layer pattern, partial RoPE, GQA on both attention
and GDN heads, MoE with a shared expert for qwen3_next, Qwen3.5's multimodal checkpoint layout,
random norms / dt_bias / A_log) are loaded through `TargetDecoder.from_pretrained` and compared
with the transformers model of the same checkpoint (the oracle).

Tolerances (fp32; hidden states O(5)): one decoder layer fed HF's input matches HF's output to 4e-6
(a few ulps: the delta rule is chunked differently, the conv summed per tap; attention layers come
out bit-equal); through the whole 8-layer stack those ulps are amplified, so aux / last hidden
states and logits are compared at 1e-4 (relative ~2e-5), and so are packed rows with each document
alone (the delta rule's chunks align differently) and TP with TP=1 (other reduction orders). A
wrong norm offset, gate, head grouping, RoPE width, shard or reset is off by >1e-2.
"""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5ForConditionalGeneration, Qwen3NextConfig

from tests.distributed.launcher import launch
from torchspec.data import collate
from torchspec.data.dataset import Example
from torchspec.distributed import init_distributed
from torchspec.targets import TargetDecoder, build_tiny_target, hybrid, llama
from torchspec.targets.capture import dense_attend
from torchspec.targets.hybrid import RecurrentShape, decoder_args

FLAVOURS = ("qwen3_next", "qwen3_5")
VOCAB = 384
LAYERS = 8
AUX = [0, 3, 6]  # GDN, attention, GDN
TP_AUX = [0, 1, 3]  # of the 4-layer targets the TP test builds
ATOL = 1e-4
LAYER_ATOL = 4e-6


@pytest.fixture(scope="module", params=FLAVOURS)
def case(request, tmp_path_factory):
    flavour = request.param
    path = build_tiny_target(str(tmp_path_factory.mktemp(flavour)), flavour, vocab_size=VOCAB, num_layers=LAYERS,
                             tie_word_embeddings=flavour == "qwen3_next", initializer_range=0.1)
    oracle = Qwen3_5ForConditionalGeneration if flavour == "qwen3_5" else AutoModelForCausalLM
    hf = oracle.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, TargetDecoder.from_pretrained(path, aux_layer_ids=AUX)


def _ids(seed=0, batch=2, seq=70):  # > 64: the delta rule spans two chunks
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def oracle_run(case):
    """(ids, transformers' output on them), shared by the tests that compare with the oracle."""
    x = _ids()
    return x, _oracle(case[1], x)


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def _oracle(hf, ids):
    return hf(ids, output_hidden_states=True)


def test_capture_equals_transformers(case, oracle_run):
    _, _, target = case
    x, ref = oracle_run
    out = target.capture(x)
    for j, i in enumerate(AUX):  # aux id i = after decoder layer i = HF's hidden_states[i + 1]
        assert _diff(out.aux_hidden_states[j], ref.hidden_states[i + 1]) <= ATOL
        assert not torch.allclose(out.aux_hidden_states[j], ref.hidden_states[i], atol=1e-2)
    assert _diff(out.last_hidden_state, ref.hidden_states[-1]) <= ATOL  # post final (1 + w) norm
    assert _diff(target.target_logits(out.last_hidden_state), ref.logits) <= ATOL
    assert _diff(target.logits(out.last_hidden_state), ref.logits) <= ATOL


def test_every_layer_equals_transformers_on_its_input(case, oracle_run):
    _, _, target = case
    x, ref = oracle_run
    hs = ref.hidden_states
    positions, attend = dense_attend(x)
    cos, sin = target.rope(positions, torch.float32)
    assert cos.shape[-1] == target.args.rotary_dim == target.args.head_dim // 4  # partial RoPE
    with torch.no_grad():
        for i, layer in enumerate(target.layers[:-1]):  # HF's last entry is post-norm
            assert _diff(layer(hs[i], cos[:, None], sin[:, None], attend), hs[i + 1]) <= LAYER_ATOL, i


def test_layer_kinds_and_recurrent_shape(case):
    _, hf, target = case
    assert target.attention_layer_ids == [3, 7] and target.linear_layer_ids == [0, 1, 2, 4, 5, 6]
    assert [hasattr(layer, "linear_attn") for layer in target.layers] == [i % 4 != 3 for i in range(LAYERS)]
    # 4 key heads x 8 + 4 x 8 (q, k) + 8 value heads x 8; value heads after GQA expansion
    assert target.args.recurrent == RecurrentShape(conv_channels=128, conv_kernel=4, num_heads=8, key_dim=8,
                                                  value_dim=8)
    assert target.layers[0].linear_attn.conv1d.weight.shape == (128, 1, 4)
    sharded = decoder_args(target.config, tp_size=4).recurrent
    assert sharded == RecurrentShape(conv_channels=32, conv_kernel=4, num_heads=2, key_dim=8, value_dim=8)


def test_loader_reads_the_saved_checkpoint(case):
    path, hf, target = case
    want = dict(hf.named_parameters())
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in want else "model."
    for name, param in target.named_parameters():
        key = name if name.startswith("lm_head.") else prefix + name
        if key in want:
            assert torch.equal(param, want[key]), name
        else:  # HF keeps qwen3_next's experts fused in memory; the checkpoint has them per expert
            layer, expert, proj = name.split(".")[1], int(name.split(".")[4]), name.split(".")[5]
            fused = hf.model.layers[int(layer)].mlp.experts
            full = fused.down_proj[expert] if proj == "down_proj" else fused.gate_up_proj[expert].chunk(2)[
                proj == "up_proj"]
            assert torch.equal(param, full), name
    assert (target.lm_head is None) == hf.config.get_text_config().tie_word_embeddings
    assert target.norm.weight.abs().max() > 0.05  # (1 + w) norms with non-trivial w


def test_right_padding_cannot_reach_real_tokens(case):
    _, _, target = case
    x = _ids(2, batch=2, seq=20)
    short = target.capture(x[:, :13])
    padded = target.capture(x)  # columns 13.. play the padding: after the real tokens
    # fp32 noise only: the padded run's chunked delta rule sums in other chunk shapes (seen: 1.15e-5 on
    # values up to ~5 on an AMD EPYC); padding that reached real tokens would move them by O(0.1-1)
    for got, want in zip([*padded.aux_hidden_states, padded.last_hidden_state],
                         [*short.aux_hidden_states, short.last_hidden_state]):
        assert _diff(got[:, :13], want) <= 1e-5 * max(1.0, want.abs().max().item())


def test_packed_rows_equal_each_document_alone(case):
    _, _, target = case
    g = torch.Generator().manual_seed(3)
    lengths = [(6, 1, 70, 4), (11, 3)]  # one document spans a chunk boundary; row 1 padded
    docs = [[torch.randint(0, VOCAB, (n,), generator=g) for n in row] for row in lengths]
    batch = collate([Example(torch.cat(row), torch.ones(sum(n), dtype=torch.long), n)
                     for row, n in zip(docs, lengths)], pad_id=0, packed=True)
    out = target.capture(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    for row, row_docs in enumerate(docs):
        lo = 0
        for doc in row_docs:
            alone = target.capture(doc[None])
            for got, want in zip([*out.aux_hidden_states, out.last_hidden_state],
                                 [*alone.aux_hidden_states, alone.last_hidden_state]):
                assert _diff(got[row : row + 1, lo : lo + len(doc)], want) <= ATOL  # chunks align differently
            lo += len(doc)
    leaky = target.capture(batch["input_ids"], position_ids=batch["position_ids"])  # positive control
    assert not torch.allclose(leaky.aux_hidden_states[0][0, 7:12], out.aux_hidden_states[0][0, 7:12], atol=1e-3)


def _config(**overrides) -> Qwen3NextConfig:
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=8, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=8)
    return Qwen3NextConfig(**{**sizes, **overrides})


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match=r"^config hidden_act='gelu' is not supported by TargetDecoder; supported"):
        decoder_args(_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"^config layer_types=\[.*'sliding_attention'.*\] is not supported"):
        decoder_args(_config(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                          "full_attention"]))
    with pytest.raises(ValueError, match=r"^config linear_num_value_heads=3 is not supported.*multiple of"):
        decoder_args(_config(linear_num_value_heads=3))
    with pytest.raises(ValueError, match=r"tensor-parallel size 4 .*num_key_value_heads=2.*linear_num_key_heads=2"):
        decoder_args(_config(), tp_size=4)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=6 not divisible by 4"):
        decoder_args(_config(num_key_value_heads=4, linear_num_key_heads=4, shared_expert_intermediate_size=6),
                     tp_size=4)
    assert decoder_args(_config(num_key_value_heads=4, linear_num_key_heads=4), tp_size=4).num_heads == 1
    # layer pattern from full_attention_interval when no layer_types are given
    assert decoder_args(_config(full_attention_interval=2)).layer_kinds == ("linear", "attention") * 2
    assert decoder_args(_config(mlp_only_layers=[1])).mlp_kinds == ("moe", "dense", "moe", "moe")
    # partial RoPE is the hybrid family's; the Llama family still refuses it
    partial = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                          num_hidden_layers=2, vocab_size=64,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"^config partial_rotary_factor=0.5 is not supported by TargetDecoder"):
        llama.decoder_args(partial)


def _tp_worker(paths, ids, packed):
    info = init_distributed(device_type="cpu")
    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    groups = {4: torch.distributed.group.WORLD, 2: pairs[info.rank // 2]}
    out = {}
    for flavour, path in paths.items():
        for tp, group in groups.items():
            target = TargetDecoder.from_pretrained(path, aux_layer_ids=TP_AUX, tp_group=group)
            plain, pack = target.capture(ids), target.capture(**packed)
            gdn = target.layers[0].linear_attn
            out[(flavour, tp)] = {
                "states": [*plain.aux_hidden_states, plain.last_hidden_state],
                "packed": [*pack.aux_hidden_states, pack.last_hidden_state],
                "tp_rank": target.tp_rank, "conv": gdn.conv1d.weight.clone(), "A_log": gdn.A_log.clone(),
                "recurrent": target.args.recurrent,
            }
    return out


def test_tensor_parallel_capture_equals_single_process(tmp_path):
    paths = {f: build_tiny_target(str(tmp_path / f), f, vocab_size=VOCAB, num_layers=4, initializer_range=0.1)
             for f in FLAVOURS}
    ids = _ids(4, batch=2, seq=12)
    packed = {"input_ids": ids, "document_ids": torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])}
    results = launch(_tp_worker, world_size=4, args=(paths, ids, packed), timeout_s=240)
    for flavour, path in paths.items():
        ref = TargetDecoder.from_pretrained(path, aux_layer_ids=TP_AUX)
        plain, pack = ref.capture(ids), ref.capture(**packed)
        with safe_open(f"{path}/model.safetensors", framework="pt") as f:
            conv = f.get_tensor(next(k for k in f.keys() if k.endswith("layers.0.linear_attn.conv1d.weight")))
        for per_rank in results:
            for tp in (4, 2):
                got = per_rank[(flavour, tp)]
                for a, b in zip(got["states"], [*plain.aux_hidden_states, plain.last_hidden_state]):
                    assert _diff(a, b) <= ATOL, (flavour, tp)
                for a, b in zip(got["packed"], [*pack.aux_hidden_states, pack.last_hidden_state]):
                    assert _diff(a, b) <= ATOL, (flavour, tp)
                # the conv's q | k | v segments are split separately: rank r holds block r of each
                r, key, value = got["tp_rank"], 32 // tp, 64 // tp
                want = torch.cat([conv[lo + r * n: lo + (r + 1) * n] for lo, n in ((0, key), (32, key), (64, value))])
                assert torch.equal(got["conv"], want)
                assert got["A_log"].shape == (8 // tp,) and got["recurrent"].conv_channels == 128 // tp


def test_families_are_registered():
    from torchspec.targets.model import ARCHITECTURES

    assert ARCHITECTURES["qwen3_next"] is hybrid and ARCHITECTURES["qwen3_5_text"] is hybrid
