"""Options of ``tools/bench_quality.py``: the parser, and ``check_args``, which checks every option, the drafter
exports and the prompt sets before a model loads (each error one line naming the option, the problem and the
fix). ``build_specs`` turns the served modes and ``--tree-shapes`` into validated ``SpecConfig``s.
"""

from __future__ import annotations

from quality_served import MODES

from recipes.bench import csv_values
from torchspec.cli import ArgumentParser, check_at_least
from torchspec.runtime.drafting import SpecConfig

DEFAULT_OUT = "docs/bench/quality_smollm2.json"
DESCRIPTION = "Served vs simulated acceptance of drafter exports on held-out prompts (issue 15, parts 3 and 5)."


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="bench_quality", description=DESCRIPTION)
    p.add_argument("--target", default="smollm2", help="HF checkpoint dir, .gguf file or alias (default smollm2)")
    p.add_argument("--cache-dir", default="~/.cache/torchspec", help="where a .gguf target is converted once")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                   help="a drafter export; NAME is the JSON's drafter column (repeatable)")
    p.add_argument("--train-tokens", action="append", default=[], metavar="NAME=N",
                   help="training tokens of drafter NAME (exports do not record them; repeatable)")
    p.add_argument("--prompt-set", default="mtbench,humaneval", help="comma-separated: mtbench, humaneval or files")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--depth", type=int, default=5, help="K: served chain and tree depth = TTT steps simulated")
    p.add_argument("--modes", default=",".join(MODES), help=f"served modes, comma-separated: {', '.join(MODES)}")
    p.add_argument("--concurrency", default="1,8,64", help="comma-separated slot counts")
    p.add_argument("--tree-topk", type=int, default=SpecConfig.topk, help="greedy tree: children per node")
    p.add_argument("--tree-nodes", type=int, default=SpecConfig.num_nodes, help="greedy tree: nodes verified")
    p.add_argument("--tree-shapes", default="", metavar="DxKxN,...",
                   help="more greedy trees served beside --modes' (depth x topk x nodes each, e.g. 6x4x24,4x8x32): "
                        "rows of mode tree with their own depth, tree_topk and tree_nodes")
    p.add_argument("--branching", default=",".join(map(str, SpecConfig.branching)),
                   help="T=1 sampled tree: children per node at each depth")
    p.add_argument("--sim-batch-size", type=int, default=8, help="held-out conversations per unroll batch")
    p.add_argument("--max-length", type=int, default=None,
                   help="the trainer's data.max_length for the simulated conversations (default: no truncation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-repeats", type=int, default=0, metavar="R",
                   help="time each served row R more times, paired with plain decoding through the same engine "
                        "(the order alternating); its speedup is then the median pair's, with the spread "
                        "(speedup_repeats, speedup_min, speedup_max). 0: one run against the plain run of step 1")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target and drafters, served and simulated (auto: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--merge", action="store_true", help="keep the rows of an existing --out not measured again")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    return p


def _pairs(flag: str, items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not (sep and name and value):
            raise ValueError(f"{flag} {item!r}: write NAME=VALUE, e.g. {flag} eagle4=...")
        if name in out:
            raise ValueError(f"{flag}: the name {name!r} is given twice; names must be distinct")
        out[name] = value
    return out


def tree_shapes(value: str) -> list[tuple[int, int, int]]:
    """``--tree-shapes`` "6x4x24,4x8x32" -> [(depth, topk, nodes), ...]."""
    shapes = []
    for item in csv_values("--tree-shapes", value) if value else []:
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--tree-shapes {item!r}: write DEPTHxTOPKxNODES, e.g. 6x4x24")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def build_specs(args) -> dict[str, SpecConfig]:
    """mode -> SpecConfig at depth K (validated); the sampled tree is the tree spec at T = 1; each of
    ``--tree-shapes`` is one more greedy tree, served as mode "tree@DxKxN"."""
    branching = tuple(csv_values("--branching", args.branching, int))
    branching += (1,) * max(0, args.depth - len(branching))
    tree = SpecConfig(shape="tree", depth=args.depth, topk=args.tree_topk, num_nodes=args.tree_nodes,
                      branching=branching)
    specs = {"chain": SpecConfig(shape="chain", depth=args.depth, branching=branching), "tree": tree,
             "sampled_tree": tree}
    for depth, topk, nodes in tree_shapes(args.tree_shapes):
        specs[f"tree@{depth}x{topk}x{nodes}"] = SpecConfig(shape="tree", depth=depth, topk=topk, num_nodes=nodes,
                                                           branching=branching + (1,) * max(0, depth - len(branching)))
    for name, spec in specs.items():
        try:
            spec.validate()
        except ValueError as e:
            raise ValueError(f"{'--tree-shapes ' + name.split('@')[1] if '@' in name else 'mode ' + name}: {e}") from None
    return specs


def check_args(args) -> dict:
    """Every option, the drafter exports and the prompt sets, before a model loads."""
    from torchspec.runtime.cli import check_drafter_export, check_output_file, read_prompt_set

    drafters = _pairs("--drafter", args.drafter)
    if not drafters:
        raise ValueError("give at least one --drafter NAME=PATH (a torchspec export)")
    for path in drafters.values():
        check_drafter_export(path)
    tokens = {}
    for name, value in _pairs("--train-tokens", args.train_tokens).items():
        if name not in drafters:
            raise ValueError(f"--train-tokens {name}=...: no --drafter is named {name!r} ({sorted(drafters)})")
        if not value.isdigit():
            raise ValueError(f"--train-tokens {name}={value!r}: give a whole number of tokens")
        tokens[name] = int(value)
    modes = csv_values("--modes", args.modes)
    if unknown := [m for m in modes if m not in MODES]:
        raise ValueError(f"--modes: {unknown} unknown; choose from {list(MODES)}")
    levels = csv_values("--concurrency", args.concurrency, int)
    for c in levels:
        check_at_least("--concurrency", c, 1)
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--sim-batch-size", args.sim_batch_size, 1),
                               ("--page-size", args.page_size, 1), ("--num-prompts", args.num_prompts, 1),
                               ("--max-length", args.max_length, 2),
                               ("--timing-repeats", args.timing_repeats, 0)):
        if value is not None:
            check_at_least(flag, value, least)
    specs = build_specs(args)
    modes += [m for m in specs if "@" in m]  # the extra tree shapes, served after --modes
    check_output_file("--out", args.out)
    sets = {name: read_prompt_set(name)[: args.num_prompts] for name in csv_values("--prompt-set", args.prompt_set)}
    return {"drafters": drafters, "train_tokens": tokens, "modes": modes, "levels": levels, "specs": specs,
            "sets": sets}
