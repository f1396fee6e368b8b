#!/usr/bin/env bash
# The GPU machine's checklist in one background run, for a device whose commands stop after
# 10 minutes: `bench/gpu_check.sh start` launches it (setsid) and returns; `bench/gpu_check.sh
# wait S` waits up to S seconds for it and copies what it has so far to $OUT. Call `wait` again
# at once (the machine goes back when idle) until it prints "gpu_check: done".
#
# What it runs, in order (each step's log in $OUT/gpu_check/): boot and stop of 32 and 64
# cameras on cuda_ipc; the `gpu` tests (with $FACECAST_REAL_FOOTAGE set to the videos in
# .footage/, for tests/test_real_footage_gpu.py); real footage through the stack and the daemon
# (bench/real_footage.py); the whole daemon against MediaPipe at 8, 32 and 64 replayed cameras
# (same definitions on both sides, bench/accounting.py); the models bench at batch 64 (the
# goals' batch) with the FaceLandmarker bundle. Run from the repository
# root, with .whl/, .models/, .mp/ and .footage/ (copies of ../shared/footage/*.mp4) carried
# (bench/gpu_host_env.sh; without dlib's 31 MB network in .models/, which no gpu test needs, they
# fit one call's 64 MiB). The machine goes back 30 s after a call ends, taking the background
# run with it: call `wait` again at once, every time.
# It took 23 minutes on the H200 (2026-11-26), and a machine is held at most 30 minutes: start it
# on a fresh machine.
set -u
STATE=/tmp/gpu_check
case "${1:-}" in
start)
    rm -rf "$STATE" && mkdir -p "$STATE"
    setsid nohup bash "$0" run > "$STATE/run.log" 2>&1 < /dev/null &
    echo "gpu_check: started"
    ;;
run)
    # On a private copy of the tree: every later call to the machine (`wait`) copies the working
    # tree over the repository again, under the running steps.
    rm -rf "$STATE/tree" && mkdir -p "$STATE/tree" && cp -r . "$STATE/tree/" && cd "$STATE/tree"
    . bench/gpu_host_env.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mp .mp/*.whl
    step() {  # name, command...
        local name=$1; shift
        echo "$(date -u +%H:%M:%S) start $name" >> "$STATE/steps.txt"
        "$@" > "$STATE/$name.log" 2>&1
        echo "$(date -u +%H:%M:%S) end $name rc=$?" >> "$STATE/steps.txt"
    }
    step boot_stop python3 bench/pipeline.py --boot-stop-only --cameras 32 64 \
        --transports cuda_ipc --source synthetic-replay --hold-s 5 \
        --out "$STATE/boot-stop.json" --log-dir "$STATE/logs"
    FACECAST_REAL_FOOTAGE=$(ls "$PWD"/.footage/*.mp4 2>/dev/null | paste -sd:)
    export FACECAST_REAL_FOOTAGE
    step gpu_tests python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests
    step real_footage bash -c "cd bench && python3 real_footage.py ${FACECAST_REAL_FOOTAGE//:/ } \
        --out '$STATE/benchmarks-real-footage.json' --log-dir '$STATE/logs'"
    step pipeline python3 bench/pipeline.py --cameras 8 32 64 --transports cuda_ipc \
        --source synthetic-replay --warmup-s 5 --measure-s 18 --mediapipe-baseline --mediapipe-path /tmp/mp \
        --baseline-warmup-s 3 --baseline-measure-s 10 --small-face-s 2 \
        --out "$STATE/benchmarks-pipeline.json" --log-dir "$STATE/logs"
    step models python3 bench/models.py --batch-sizes 64 --cameras 32 --budget-s 200 \
        --face-landmarker-task .models/face_landmarker.task --out "$STATE/benchmarks-models.json"
    echo "gpu_check: done" >> "$STATE/steps.txt"
    ;;
wait)
    deadline=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $deadline ] && ! grep -q "gpu_check: done" "$STATE/steps.txt" 2>/dev/null; do
        sleep 5
    done
    mkdir -p "$OUT/gpu_check"
    for part in "$STATE"/*; do  # not the tree's copy
        [ "$(basename "$part")" = tree ] || cp -r "$part" "$OUT/gpu_check/" 2>/dev/null
    done
    cat "$STATE/steps.txt" 2>/dev/null
    ;;
*)
    echo "usage: $0 start | wait [SECONDS]" >&2
    exit 2
    ;;
esac
