"""The one target decoder on CUDA (skipped without a GPU): training capture (dense SDPA) == the serving
forward (PagedAttend over the paged KV cache) on the same tokens, in fp32 tightly and in bf16 within
a stated tolerance, plus packed rows == documents alone in bf16.

bf16 tolerance, stated: the two forwards run the same weights and ops except attention (SDPA's
fused kernels vs gathered pages + masked SDPA), so they differ only by bf16 rounding that the
layers carry forward. We require, per captured state and for the last hidden, a max abs error of
at most 2% of that tensor's max magnitude, and top-1 agreement of the target logits on >= 97% of
positions (disagreements must be near-ties: the logit gap at such positions <= 0.1).
"""

from __future__ import annotations

import pytest
import torch

from torchspec.runtime.paged_kv import PageAllocator, PagedAttend, PagedKVCache, build_attention_meta
from torchspec.targets import TargetDecoder, build_tiny_target

pytestmark = pytest.mark.gpu

AUX = [1, 3, 5]
B, T, PAGE = 2, 96, 16
REL_TOL_BF16 = 2e-2
TOP1_AGREEMENT_BF16 = 0.97


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target_dir(request, tmp_path_factory):
    return build_tiny_target(str(tmp_path_factory.mktemp(f"gpu_{request.param}")), request.param, vocab_size=384,
                             num_layers=8, hidden_size=128, num_heads=8, num_kv_heads=2, initializer_range=0.05)


def paged_forward(dec: TargetDecoder, ids: torch.Tensor):
    b, t = ids.shape
    pages_per_row = -(-t // PAGE)
    cache = PagedKVCache.for_target(dec, b * pages_per_row + 1, PAGE)
    block_table = torch.tensor(PageAllocator(b * pages_per_row + 1).alloc(b * pages_per_row)).view(b, -1).cuda()
    causal = torch.ones(t, t, dtype=torch.bool, device="cuda").tril().expand(b, t, t)
    meta = build_attention_meta(block_table, torch.zeros(b, dtype=torch.long, device="cuda"), causal, PAGE)
    return dec(ids, torch.arange(t, device="cuda").expand(b, t), PagedAttend(cache, meta), capture_layers=AUX)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@torch.no_grad()
def test_capture_equals_paged_serving_fp32(target_dir):
    dec = TargetDecoder.from_pretrained(target_dir, AUX, dtype=torch.float32, device="cuda")
    ids = torch.randint(0, 384, (B, T), generator=torch.Generator().manual_seed(0)).cuda()
    cap, srv = dec.capture(ids), paged_forward(dec, ids)
    for a, b in zip([*cap.aux_hidden_states, cap.last_hidden_state], [*srv.aux, srv.hidden]):
        assert (a - b).abs().max().item() <= 1e-4


@torch.no_grad()
def test_capture_equals_paged_serving_bf16(target_dir):
    dec = TargetDecoder.from_pretrained(target_dir, AUX, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 384, (B, T), generator=torch.Generator().manual_seed(1)).cuda()
    cap, srv = dec.capture(ids), paged_forward(dec, ids)
    errors = [rel_err(a, b) for a, b in zip([*cap.aux_hidden_states, cap.last_hidden_state], [*srv.aux, srv.hidden])]
    assert max(errors) <= REL_TOL_BF16, errors
    want, got = dec.target_logits(srv.hidden), dec.target_logits(cap.last_hidden_state)
    agree = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= TOP1_AGREEMENT_BF16, agree
    top2 = want.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1])[want.argmax(-1) != got.argmax(-1)]
    assert (gaps <= 0.1).all(), gaps  # every disagreement is a near-tie


@torch.no_grad()
def test_packed_rows_equal_documents_alone_bf16(target_dir):
    dec = TargetDecoder.from_pretrained(target_dir, AUX, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(2)
    lengths = [40, 7, 33]
    docs = [torch.randint(0, 384, (n,), generator=g).cuda() for n in lengths]
    ids = torch.cat([*docs, torch.zeros(8, dtype=torch.long, device="cuda")])[None]  # + 8 padding tokens
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((8,), -1)])[None].cuda()
    packed = dec.capture(ids, document_ids=doc_ids)
    assert torch.isfinite(packed.last_hidden_state).all()
    start = 0
    for doc in docs:
        alone = dec.capture(doc[None])
        for a, b in zip([*packed.aux_hidden_states, packed.last_hidden_state],
                        [*alone.aux_hidden_states, alone.last_hidden_state]):
            assert rel_err(a[:, start:start + len(doc)], b) <= REL_TOL_BF16
        start += len(doc)
