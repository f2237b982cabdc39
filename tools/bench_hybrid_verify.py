"""Serving costs of a hybrid Gated-DeltaNet target at the Qwen3.5-27B shape (GPU): decode, verification, commit, capture.

    python tools/bench_hybrid_verify.py --json docs/bench/hybrid_verify_h200.json          # all 64 layers
    python tools/bench_hybrid_verify.py --layers 16 --batch 1,4                           # fewer layers
    python tools/bench_hybrid_verify.py --smoke --json /tmp/smoke.json                    # CPU, tiny shape

Builds the target from a config with random bf16 weights (nothing to download; speed only): hidden
5120, 64 layers with full attention every 4th (48 Gated DeltaNet + 16 attention), GDN 16 key / 48
value heads of dim 128 with a conv of 4, attention 24 q / 4 KV heads of dim 256 (partial RoPE 1/4),
MLP 17408, vocabulary 248320 (Qwen3.5-27B's text config). ``--layers N`` keeps the first N layers
(the same 3:1 pattern) and the output says so. Per batch size, after a prefill of ``--ctx`` tokens
per row, it times with CUDA events (warm-up, then the median of ``--iters``), each step replayed as a
CUDA graph the way the engine runs it:

    plain_step          one decode step (``steps.plain_step``: forward, lm_head, argmax, state commit)
    verify_tree         the target side of a round over a 16-node draft tree (root + 15, depths 1-4):
                        tree-masked forward with the tree recurrence, lm_head on every node, greedy
                        verification, commit of the accepted node's state; level widths = the bound
                        `tree_level_widths` gives a dynamic top-4 tree (what greedy rounds step)
    verify_tree_exact   the same tree stepped with its exact level widths (what sampled trees get)
    verify_chain        the same for an 8-token chain (root + 7)
    commit              `RecurrentStep.commit` alone (48 layers' conv + ssm state of one node per row)
    capture             training capture, ``TargetDecoder.capture`` at ``--capture-batch`` x ``--capture-seq``

and reports each in ms and in plain-step units, the tree recurrence's node-steps and snapshot memory.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # Qwen3.5-27B's text config; "smoke" keeps its structure at toy sizes (CPU)
    "qwen3.5-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16),
}
TREE_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 9, 11, 13]  # 16 nodes; per depth 1, 4, 6, 3, 2


def hf_config(shape: str, layers: int | None):
    from transformers import Qwen3_5TextConfig

    kw = dict(SHAPES[shape])
    kw["num_hidden_layers"] = layers or kw["num_hidden_layers"]
    return Qwen3_5TextConfig(**kw, linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144,
                             rms_norm_eps=1e-6, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


@torch.no_grad()
def build_decoder(config, dtype: torch.dtype, device: torch.device):
    """Built on meta, then each parameter allocated in ``dtype`` on ``device`` (never a full fp32 copy)."""
    from torchspec.targets import TargetDecoder, default_aux_layer_ids

    n = config.num_hidden_layers
    aux = default_aux_layer_ids(n) if n >= 8 else [0, 1, n - 1]
    with torch.device("meta"):
        decoder = TargetDecoder(config, aux_layer_ids=aux)
    for module in decoder.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            t = torch.empty(p.shape, dtype=dtype, device=device)
            t.normal_(0.0, 0.02) if p.dim() >= 2 else t.zero_()  # 1-D: norms (1 + w), A_log, dt_bias
            setattr(module, name, torch.nn.Parameter(t, requires_grad=False))
    decoder.rope.to(device)
    return decoder


def timed(fn, iters: int, warmup: int, cuda: bool) -> float:
    """Median ms of ``fn()`` over ``iters`` runs after ``warmup`` (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def tree_inputs(parents: list[int], b: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.tensor(parents, device=device)
    depths = torch.zeros_like(p)
    for i in range(1, len(parents)):
        depths[i] = depths[p[i]] + 1
    tokens = torch.randint(0, vocab, (b, len(parents)), device=device)
    return tokens, p.expand(b, -1).clone(), depths.expand(b, -1).clone()


def bench_batch(decoder, b: int, args, cuda: bool) -> list[dict]:
    from torchspec.runtime.drafting import SpecConfig
    from torchspec.runtime.graphs import StepGraphs
    from torchspec.runtime.paged_kv import PagedKVCache, build_attention_meta
    from torchspec.runtime.recurrent_state import RecurrentState, tree_level_widths
    from torchspec.runtime.sampling import SamplingParams
    from torchspec.runtime.steps import Caches, plain_step, prefill, target_attend
    from torchspec.runtime.tree import DraftTree
    from torchspec.runtime.verify import verify_greedy

    dev, page, greedy = decoder.embed_tokens.weight.device, 16, SamplingParams()
    per_row = (args.ctx + 64) // page + 1
    caches = Caches(PagedKVCache.for_target(decoder, b * per_row + 1, page), None, page,
                    RecurrentState.for_target(decoder, b))
    bt = 1 + torch.arange(b * per_row, device=dev).view(b, per_row)
    ctx = torch.full((b,), args.ctx, device=dev)
    valid = torch.ones(b, dtype=torch.bool, device=dev)
    prompts = torch.randint(0, decoder.vocab_size, (b, args.ctx), device=dev)
    root = prefill(decoder, None, caches, bt, prompts, ctx, greedy, None).root
    graphs = StepGraphs() if cuda else None

    def run(key, fn, inputs):
        return (lambda: graphs.run(key, fn, inputs)) if cuda else (lambda: fn(**inputs))

    def verify(tokens, parents, depths, widths, keep=None):
        d = len(widths) - 1
        tree = DraftTree(tokens=tokens, parents=parents, depths=depths, valid=torch.ones_like(tokens, dtype=torch.bool),
                         sampled=torch.zeros_like(tokens, dtype=torch.bool), sibling_rank=torch.zeros_like(tokens),
                         dist_index=torch.full_like(tokens, -1))
        meta = build_attention_meta(bt, ctx, tree.attention_mask(d), page, row_valid=valid)
        attend = target_attend(caches, meta, None, valid, parents=parents, depths=depths, level_widths=widths)
        out = decoder(tokens, ctx[:, None] + depths, attend)
        res = verify_greedy(tree, decoder.argmax(out.hidden), max_depth=d)
        if keep is not None:
            keep.append(attend)
            return res.num_accepted
        attend.commit(res.path.gather(1, res.num_accepted[:, None])[:, 0], valid)
        return res.num_accepted

    rec = decoder.args.recurrent
    state_bytes = 4 * rec.num_heads * rec.key_dim * rec.value_dim * len(decoder.linear_layer_ids)  # ssm per node
    rows = []
    plain_ms = timed(run("plain", lambda root: plain_step(decoder, caches, bt, ctx, root, valid, greedy, None),
                         {"root": root}), args.iters, args.warmup, cuda)
    rows.append({"name": "plain_step", "batch": b, "ms": plain_ms, "nodes": 1, "node_steps": 1})
    tokens, parents, depths = tree_inputs(TREE_PARENTS, b, decoder.vocab_size, dev)
    exact = tuple(int((depths[0] == d).sum()) for d in range(int(depths.max()) + 1))
    bound = tree_level_widths(SpecConfig(shape="tree", depth=len(exact) - 1, topk=4, num_nodes=len(TREE_PARENTS) - 1),
                              greedy)
    chain = tree_inputs(list(range(-1, 7)), b, decoder.vocab_size, dev)
    cases = {"verify_tree": (tokens, parents, depths, bound), "verify_tree_exact": (tokens, parents, depths, exact),
             "verify_chain": (*chain, (1,) * 8)}
    for name, (tok, par, dep, widths) in cases.items():
        fn = run(name, lambda tok, par, dep, w=widths: verify(tok, par, dep, w), {"tok": tok, "par": par, "dep": dep})
        ms = timed(fn, args.iters, args.warmup, cuda)
        rows.append({"name": name, "batch": b, "ms": ms, "nodes": tok.shape[1], "level_widths": list(widths),
                     "node_steps": sum(widths), "snapshot_bytes": sum(widths) * b * state_bytes})
    keep: list = []
    verify(*cases["verify_tree"][:3], bound, keep=keep)
    last = torch.full((b,), 13, device=dev)  # a depth-3 node
    step = keep[0].recurrent
    fn = run("commit", lambda last: step.commit(last, valid), {"last": last})
    rows.append({"name": "commit", "batch": b, "ms": timed(fn, args.iters, args.warmup, cuda), "nodes": 1,
                 "state_bytes_per_row": state_bytes})
    for r in rows:
        r["plain_steps"] = r["ms"] / plain_ms
    return rows


def bench_capture(decoder, args, cuda: bool) -> dict:
    ids = torch.randint(0, decoder.vocab_size, (args.capture_batch, args.capture_seq),
                        device=decoder.embed_tokens.weight.device)
    ms = timed(lambda: decoder.capture(ids), max(3, args.iters // 4), args.warmup, cuda)
    return {"name": "capture", "batch": args.capture_batch, "seq": args.capture_seq, "ms": ms,
            "tokens_per_s": args.capture_batch * args.capture_seq / (ms / 1e3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 64)")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--ctx", type=int, default=1024, help="committed tokens per row")
    p.add_argument("--capture-batch", type=int, default=1)
    p.add_argument("--capture-seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here (docs/bench/...)")
    p.add_argument("--fused", action="store_true",
                   help="serving steps on `TargetDecoder.fuse_for_serving()` (capture is timed before, unfused)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few iterations (a unit test runs it)")
    args = p.parse_args()
    if args.smoke:
        args.shape, args.ctx, args.iters, args.warmup, args.capture_seq = "smoke", 24, 2, 1, 32
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    config = hf_config(args.shape, args.layers)
    decoder = build_decoder(config, torch.bfloat16 if cuda else torch.float32, dev)
    from torchspec.targets.gdn_ops import uses_fla

    n, full = config.num_hidden_layers, SHAPES[args.shape]["num_hidden_layers"]
    print(f"shape {args.shape}: layers {n} of {full} ({len(decoder.linear_layer_ids)} GDN, "
          f"{len(decoder.attention_layer_ids)} attention), ctx {args.ctx}, device "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}, fla {uses_fla(dev)}, fused {args.fused}")
    capture = bench_capture(decoder, args, cuda)  # training never runs the serving fusion
    if args.fused:
        decoder.fuse_for_serving()
    results = []
    for b in (int(x) for x in args.batch.split(",")):
        results += bench_batch(decoder, b, args, cuda)
    results.append(capture)
    print(f"{'step':<18} {'batch':>5} {'ms':>9} {'plain steps':>12}  notes")
    for r in results:
        notes = (f"{r['nodes']} nodes, {r['node_steps']} node-steps {r['level_widths']}, snapshots "
                 f"{r['snapshot_bytes'] / 2**20:.1f} MiB" if "level_widths" in r else
                 f"{r['tokens_per_s']:.0f} tokens/s at {r['batch']} x {r['seq']}" if r["name"] == "capture" else "")
        steps = f"{r['plain_steps']:12.2f}" if "plain_steps" in r else f"{'':12}"
        print(f"{r['name']:<18} {r['batch']:>5} {r['ms']:9.3f} {steps}  {notes}")
    if args.json:
        out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": args.shape, "layers": n,
               "model_layers": full, "fla": uses_fla(dev), "config": SHAPES[args.shape], "args": vars(args),
               "results": results}
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
