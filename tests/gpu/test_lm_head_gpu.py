"""The efficient head's two-stage candidate selection on CUDA (skipped without a GPU): the same set as
one ``topk`` over the vocabulary, eager and inside a CUDA graph, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from torchspec.models.lm_head import EfficientLMHead, chunked_topk, select_chunk

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 4, 37])
def test_chunked_topk_on_cuda_is_the_topk_set(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    scores = torch.randn(rows, 49152, device="cuda", generator=g)  # fp32: distinct values
    chunk = select_chunk(49152, 128)
    ids = chunked_topk(scores, 128, chunk)
    assert torch.equal(ids.sort(-1).values, scores.topk(128, dim=-1).indices.sort(-1).values)
    b = scores.bfloat16()  # bf16 has ties: compare the selected values, which are unique as a multiset
    vals = b.gather(-1, chunked_topk(b, 128, chunk)).sort(-1).values
    assert torch.equal(vals, b.topk(128, dim=-1).values.sort(-1).values)


def test_candidates_in_a_cuda_graph_equal_eager():
    torch.manual_seed(0)
    head = EfficientLMHead(576, 49152, rank=128, topk=128, device="cuda", dtype=torch.bfloat16)
    assert head.select_chunk == 4096
    h = torch.randn(8, 576, device="cuda", dtype=torch.bfloat16)
    ids0, logits0 = head.candidates(h)
    static = h.clone()
    for _ in range(2):
        head.candidates(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids_g, logits_g = head.candidates(static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ids_g, ids0) and torch.equal(logits_g, logits0)
