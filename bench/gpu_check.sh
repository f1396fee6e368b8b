#!/usr/bin/env bash
# The GPU machine's checklist in one background run, for a device whose commands stop after
# 10 minutes: `bench/gpu_check.sh start [STEP...]` launches it (setsid) and returns;
# `bench/gpu_check.sh wait S` waits up to S seconds for it and copies what it has so far to
# $OUT/gpu_check/results.tar.gz (with steps.txt beside it).
# Call `wait` again at once (the machine goes back when idle) until it prints "gpu_check: done".
#
# `bench/gpu_check.sh install` installs the wheel folders a call carries (see below).
# Steps (each one's log in the archive; minutes on the H200, 2026-11-26):
#   boot_stop     boot and stop of 32 and 64 replayed cameras on cuda_ipc (2)
#   gpu_tests     the `gpu` tests, with $FACECAST_REAL_FOOTAGE set to the videos in .footage/ for
#                 tests/test_real_footage_gpu.py, and tests/test_nvdec_gpu.py where PyAV and
#                 PyNvVideoCodec are installed (.whl2a/, .whl2b/: bench/gpu_host_env.sh) (10-11;
#                 15 with every wheel, 139 tests, H100 2026-11-27; 17 with every wheel, 161 tests,
#                 H200 2026-11-28: 123 in the first 9.3 minutes, the rest 7.5); each test's
#                 daemon log comes back in daemon-logs/ (tests/test_nvdec_gpu.py alone: 2.1
#                 minutes on the H200, 2026-11-28 20:09)
#   cpu_tests     $CPU_TESTS' tests that need no GPU, on this host's Python 3.12 and packages
#                 (PyAV 19, which CI's Python 3.11 cannot install)
#   real_footage  real footage through the stack and the daemon (bench/real_footage.py) (4.5)
#   pipeline      the whole daemon against MediaPipe at 8, 32 and 64 replayed cameras (same
#                 definitions on both sides, bench/accounting.py) (5-6)
#   models        the models bench at batch 64 (the goals' batch) with the FaceLandmarker bundle,
#                 the "+compile" variants included (Note [Compiled models]) (3-5)
#   decode        issue 22's table: 8 to 64 synthetic-h264 cameras decoded by NVDEC and by the CPU
#                 (needs .whl2a/.whl2b installed) (22 on the H100: 8 GPU, 14 CPU; 11.7 on the
#                 H200 pair, 2026-11-28: 5.7 GPU, 3 + 3 CPU in two calls of $DECODE_CAMERAS;
#                 13 on one H200 at 20:11: 5.7 GPU, 7.3 CPU, `decode_cpu` in a call of its own),
#                 on GPU 0 where there are two; `decode_gpu` and `decode_cpu` run one side each,
#                 so that each can have calls of its own; $DECODE_CAMERAS (counts) runs those
#                 counts only
#   decode_profile  where the capture, roi_landmark and detection workers' CPU goes at 64
#                 NVDEC-decoded synthetic-h264 cameras (py-spy, --profile-roles) (2.5)
#   two_gpus      issue 22 item 4, on the nvidia-h100-x2 kind: 64 synthetic-h264 cameras on one
#                 GPU (CUDA_VISIBLE_DEVICES=0, Note [Visible GPUs]) against 128 on both, NVDEC
#                 decoding (needs .whl2a/.whl2b) (3.5, H100 x2 2026-11-26; 3.2-3.4 on the
#                 H200 pair, 2026-11-28: .models/ must come too, as for every daemon step)
#   two_gpus_stop the 128-camera boot and stop on the nvidia-h100-x2 kind, twice, with the workers'
#                 closing and ending times in the logs (needs .whl2a/.whl2b) (3)
#   newcomers     issue 24 item 5: how late a person who walks in is published, 8 and 32 staged
#                 replayed cameras (bench/pipeline.py --newcomers) (2.5, H100)
#   ab            the daemon at 32 and 64 replayed cameras on a baseline commit (.base/, carried)
#                 and on this tree, the same machine, one after the other (6, H100)
#   ab_decode     ab with 64 NVDEC-decoded synthetic-h264 cameras, base then head (4)
#   newcomers_ab  newcomers on .base/ and on this tree, one after the other (5, H100)
#   models_ab     bench/models.py at batch 64, fp16 with graphs, compiled and not, on .base/ and
#                 on this tree, one after the other (8)
#   triton        bench/kernels.py: each Triton kernel (crops, detections' decoding, weighted NMS,
#                 duplicate filter, transformation matrix, layer norm, PReLUs, biases, depthwise
#                 convolutions, the attention mesh's custom operators) against the PyTorch chain
#                 it replaces (0.5)
#   phases        the daemon at 32 and 64 replayed cameras genlocked (every camera at phase 0,
#                 as before 2026-11-27) and free-running (each at its own phase, the default),
#                 one after the other (Note [Capture phases]) (6, H100); `genlocked`: its
#                 first half alone, to follow `pipeline` (3)
#   mps           the daemon at 32 and 64 replayed cameras under NVIDIA MPS (the workers' kernels
#                 run side by side instead of taking time slices; compare with `ab`'s head) (3)
#   mps_ab        the daemon at $MPS_AB_CAMERAS (64) replayed cameras without NVIDIA MPS, then
#                 under it, one machine, no traces (3, H100)
#   gpu_time      where the GPU's time goes at 64 replayed cameras, by process (every worker's
#                 CUDA activity through 3 s, bench/gpu_trace.py; Note [Where the GPU's time goes]):
#                 the defaults, float16 models, one roi_landmark worker, and the defaults under
#                 NVIDIA MPS where it is installed, one after the other (6-7, H100)
#   spare_wakeups bench/spare_wakeups.py: an idle CUDA context's driver thread beside GPU work
#                 of each kind the daemon does, one phase a kind (issue 24 item 4); $SPARE_PHASES
#                 (names) runs those phases only (1.5 for the first six, H100 2026-11-28; 2.3
#                 for nine, the `*_stopped` ones with the watched spare stopped: Note [Spares
#                 paused while they stand by])
#   probes        each .footage/*_probe.py carried (a session's probes, kept out of the repository)
#   half          the daemon at 32 and 64 replayed cameras with its default float32 models, then
#                 with float16 ones (models.half), one after the other (5, H100 2026-11-27)
#   conv          bench/conv_kernels.py: each convolution under each kernel, fp16 and fp32, and the
#                 float16 depthwise ones in NCHW, in float32 and in our kernel ("Triton dw") (1)
#   kernels       where each model's GPU time goes (.footage/kernel_probe.py when carried: kernel
#                 counts, top kernels, eager/graph, cudnn.benchmark, inductor on one model) (1)
#   roi_workers   64 replayed cameras with one roi_landmark worker, then two (the default's
#                 count: Note [Measuring workers per GPU]) (5.5, H100)
#   groups_decode 64 NVDEC cameras in capture processes of 16 (auto), then of 8 (4); or of
#                 each size in $GROUPS_DECODE
#   detection_share  32 and 64 replayed cameras with daemon.detection_share 0.5 (auto), 0.25 and
#                 0.1, then newcomers at 32 cameras with 0.5 and 0.25, one machine (12, H100)
#   worker_memory the inference workers' GPU memory as spares and once promoted, and what a
#                 promotion's graph capture costs, at 64 cameras (bench/worker_memory.py) (1.5)
#   stages        where the face stacks' and the detection pass's GPU time goes, step by step
#                 (bench/model_stages.py: kernel time under each step, the graphed wall, the host's
#                 share of a synchronous call, and the graphed stack's kernels) (2)
#   analyze       issue 23's GPU rows: `facecast analyze` on CUDA over 1080p and 720p H.264 files
#                 with one and four faces, decoded by NVDEC (needs .whl2a/.whl2b), eight files at
#                 once, against LiteRT on 1 and 8 threads in the same run; files of 600 frames
#                 (20 s), not 240: a file's decoder creation and its last odd batch weighed on
#                 the rate of 240-frame files (4, H100 2026-11-26)
#   analyze_jobs  issue 23's goal with `--jobs` (Note [Jobs]): 32 copies of the 1080p one-face
#                 file in this process, then as the command with --jobs 1 and 4 (needs
#                 .whl2a/.whl2b) (5; 2.4 on the H200, 2026-11-28)
# Default: boot_stop gpu_tests real_footage pipeline models (23 minutes). A machine is held at
# most 30 minutes: start on a fresh machine, and put `decode` in a run of its own. Device time
# is 30 minutes a session, and a one-GPU loan may count only part of its held time or all of it
# (2026-11-26: 50 %, then 100 % from the 25th minute; 2026-11-27: 67 %): gpu_tests alone (139
# tests, 15 min on the H100 with every wheel) can take half of a session's time.
# Run from the repository root, with .whl/, .models/, .mp/ and .footage/ (copies of
# ../shared/footage/*.mp4) carried (bench/gpu_host_env.sh; they fit one call's 64 MiB). The
# machine goes back 30 s after a call ends, taking the background run with it: call `wait` again
# at once, every time. Even so it went back between two calls made at once (2026-11-26, and
# 2026-11-28 with `gpu_tests` 1 minute in, at 12 minutes held; and again on an H200 the same day,
# 16 s between the calls, at 12 minutes held: the next call's run found no .whl/ and failed,
# which `wait` now notices at once): put the step that matters most
# first, and where steps fit 9.5 minutes, give each a call of its own (`start STEP; wait 570`),
# so that none spans two calls (2026-11-28: `pipeline` and a `GPU_TESTS` subset so, lost none).
set -u
STATE=/tmp/gpu_check
DEFAULT_STEPS="boot_stop gpu_tests real_footage pipeline models"
case "${1:-}" in
install)
    # The wheel folders this call carries, installed for the later calls to this machine (the
    # big ones, .whl2a/ .whl2b/ .whl2c/, in calls of their own: carry .whl2a alone, then .whl2b
    # and .whl2c together, then start the run carrying .whl/, .models/ and .footage/; 2 s each,
    # H200 2026-11-28). Says what the machine has. A call may carry 64 MiB with the tree (9.5
    # MB): .whl/ (18 MB) and .whl2a/ (35) together, or .whl2b/ (27), .models/ (27.5), .footage/
    # and .base/ (2.6) together. .models/ goes whole: without the pose models the daemon does
    # not start (`models missing`) and its tests ask pip for MediaPipe (2026-11-28); an ignored
    # folder carried once stays on the warm machine, and a call may carry single files of it.
    . bench/gpu_host_env.sh
    echo "gpu_check: installed: $(ls -A /tmp/fc | tr '\n' ' ')"
    ;;
start)
    shift
    rm -rf "$STATE" && mkdir -p "$STATE"
    setsid nohup bash "$0" run "${@:-$DEFAULT_STEPS}" > "$STATE/run.log" 2>&1 < /dev/null &
    echo $! > "$STATE/pid"
    echo "gpu_check: started"
    ;;
run)
    shift
    # On a private copy of the tree: every later call to the machine (`wait`) copies the working
    # tree over the repository again, under the running steps.
    rm -rf "$STATE/tree" && mkdir -p "$STATE/tree" && cp -r . "$STATE/tree/" && cd "$STATE/tree"
    . bench/gpu_host_env.sh
    [ -d .mp ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mp .mp/*.whl
    FACECAST_REAL_FOOTAGE=$(ls "$PWD"/.footage/*.mp4 2>/dev/null | paste -sd:)
    export FACECAST_REAL_FOOTAGE
    step() {  # name, command...
        local name=$1; shift
        echo "$(date -u +%H:%M:%S) start $name" >> "$STATE/steps.txt"
        "$@" > "$STATE/$name.log" 2>&1
        echo "$(date -u +%H:%M:%S) end $name rc=$?" >> "$STATE/steps.txt"
    }
    mps_start() {  # NVIDIA MPS's control daemon, and this shell's processes its clients
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d
    }
    mps_stop() {
        echo quit | nvidia-cuda-mps-control
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    }
    ab_script() {  # name, script, its arguments: on .base/, then on this tree (--out added, and
        # bench/pipeline.py's --log-dir)
        local name=$1 script=$2; shift 2
        if [ ! -d .base ]; then
            echo "$(date -u +%H:%M:%S) $name: no .base/ carried" >> "$STATE/steps.txt"
            return
        fi
        ln -sfn "$PWD/.models" .base/.models
        for side in base head; do
            local root=$PWD; [ $side = base ] && root=$PWD/.base
            local logs=""; [ "$script" = bench/pipeline.py ] && logs="--log-dir '$STATE/logs-$name-$side'"
            step "$name-$side" bash -c "cd '$root' && . bench/gpu_host_env.sh && \
                python3 $script $* $logs --out '$STATE/benchmarks-$name-$side.json'"
        done
        . bench/gpu_host_env.sh  # facecast.* back to this tree
    }
    ab_runs() {  # name, bench/pipeline.py arguments: on .base/, then on this tree; on GPU 0
        # alone, as the goals count, also on a host of two (2026-11-28 `ab_decode` on the x2
        # kind spread its 64 cameras over both GPUs)
        local name=$1; shift
        CUDA_VISIBLE_DEVICES=0 ab_script "$name" bench/pipeline.py --transports cuda_ipc "$@"
    }
    for name in $*; do
        case $name in
        boot_stop) step boot_stop python3 bench/pipeline.py --boot-stop-only --cameras 32 64 \
            --transports cuda_ipc --source synthetic-replay --hold-s 5 \
            --out "$STATE/boot-stop.json" --log-dir "$STATE/logs" ;;
        gpu_tests) # The files whose code changes most often first, should the machine go back.
            # One process (no pytest-xdist, which tests/conftest.py would otherwise use where it
            # is installed): the gpu tests were measured one at a time, on one GPU.
            # Without PyAV (.whl2a/ not carried yet) the decoding tests' modules cannot even be
            # collected (facecast's decoders import it): leave them out, and say so.
            without_av=""
            if ! python3 -c "import av" 2> /dev/null; then
                for f in test_decoding test_mjpeg_decoding test_nvdec_gpu test_nvjpeg_gpu \
                        test_analyze_nvdec_gpu; do
                    without_av="$without_av --ignore=tests/$f.py"
                done
                echo "$(date -u +%H:%M:%S) gpu_tests: no PyAV, decoding tests left out" >> "$STATE/steps.txt"
            fi
            # $GPU_TESTS (paths) runs those files only: a session's short check of what changed.
            # Sorted, so that each folder's files come together: with a file of tests/ between
            # two of tests/models/, the later ones' conftest fixtures were "not found" on the
            # GPU machine's pytest (2026-11-27).
            test_paths="tests/models tests/test_cuda_rules.py tests/test_foreign_writer.py
                tests/test_daemon_gpu.py tests/test_real_footage_gpu.py tests"
            [ -n "${GPU_TESTS:-}" ] && test_paths=$(printf '%s\n' $GPU_TESTS | sort)
            # Each test's daemon log kept (a failing takeover's timings are in it), not the
            # rest of its folder (recordings, encoded footage).
            step gpu_tests python3 -m pytest -q -rs -m gpu -p no:cacheprovider -p no:xdist --durations=30 $without_av \
                --basetemp "$STATE/pytest-tmp" $test_paths
            mkdir -p "$STATE/daemon-logs"
            for log in $(find "$STATE/pytest-tmp" -name daemon.log); do
                cp "$log" "$STATE/daemon-logs/$(basename "$(dirname "$log")").log"
            done
            rm -rf "$STATE/pytest-tmp" ;;
        cpu_tests) # $CPU_TESTS (paths): their tests that need no GPU, on this host's Python 3.12
            # and its packages, which CI (Python 3.11) cannot install: PyAV 19 (cp312 and later
            # only), whose changes broke `facecast analyze` (2026-11-27) where CI saw nothing.
            # The GPU hidden: with it, 9 of these tests failed for the device they met (a
            # stand-in decoder without a device, a GPU recorder's name; 2026-11-27 23:34).
            step cpu_tests env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -rs -m "not gpu" -p no:cacheprovider -p no:xdist \
                $(printf '%s\n' ${CPU_TESTS:-tests/test_recording.py tests/test_analyze.py} | sort) ;;
        real_footage) step real_footage bash -c "cd bench && python3 real_footage.py \
            ${FACECAST_REAL_FOOTAGE//:/ } --out '$STATE/benchmarks-real-footage.json' \
            --log-dir '$STATE/logs'" ;;
        pipeline) step pipeline python3 bench/pipeline.py --cameras 8 32 64 \
            --transports cuda_ipc --source synthetic-replay --warmup-s 5 --measure-s 18 \
            --mediapipe-baseline --mediapipe-path /tmp/mp --baseline-warmup-s 3 \
            --baseline-measure-s 10 --small-face-s 2 \
            --profile-roles capture roi_landmark detection output \
            --out "$STATE/benchmarks-pipeline.json" --log-dir "$STATE/logs" ;;
        ab) # The same daemon runs on the baseline in .base/ (`git archive BASE | tar -x -C .base`
            # here, carried) and on this tree, one after the other on this machine: the ratio of
            # the changes since BASE, without MediaPipe.
            ab_runs ab --cameras 32 64 --source synthetic-replay --warmup-s 5 --measure-s 15 ;;
        newcomers_ab) # newcomers' step on .base/ and on this tree, one after the other.
            ab_runs newcomers-ab --newcomers --cameras 8 32 --source synthetic-replay --warmup-s 5 \
                --measure-s 12 ;;
        models_ab) # bench/models.py on .base/ and on this tree, one after the other: the goals'
            # figures at batch 64 in fp16 with graphs, compiled and not.
            ab_script models-ab bench/models.py --batch-sizes 64 --cameras 32 --variants fp16+graphs \
                fp16+graphs+compile --budget-s 300 --landmarker-task .models/face_landmarker.task \
                --docs "''" ;;
        spare_wakeups) # Issue 24 item 4: what wakes an idle CUDA context's driver thread.
            step spare_wakeups python3 bench/spare_wakeups.py ${SPARE_PHASES:+--phases $SPARE_PHASES} \
                --out "$STATE/benchmarks-spare-wakeups.json" ;;
        probes) # A session's probes kept out of the repository (.footage/*_probe.py), each run
            # once with its output in probe-NAME.log.
            for probe in .footage/*_probe.py; do
                [ -f "$probe" ] && step "probe-$(basename "$probe" .py)" python3 "$probe"
            done ;;
        triton) # Note [Kernels of our own]: each Triton kernel against its PyTorch chain.
            step triton python3 bench/kernels.py --out "$STATE/benchmarks-kernels.json" ;;
        ab_decode) # ab's pair with 64 NVDEC-decoded synthetic-h264 cameras (needs .whl2a/.whl2b).
            ab_runs ab-decode --cameras 64 --source synthetic-h264 --decode gpu --warmup-s 4 \
                --measure-s 10 ;;
        phases|genlocked) # Note [Capture phases]: genlocked, then free-running (the default,
            # as `pipeline` runs), one machine; `genlocked` alone after a `pipeline` step.
            phase_kinds="genlocked free"; [ $name = genlocked ] && phase_kinds=genlocked
            for phases in $phase_kinds; do
                step "phases-$phases" python3 bench/pipeline.py --cameras 32 64 \
                    --transports cuda_ipc --source synthetic-replay --warmup-s 5 --measure-s 15 \
                    $([ $phases = genlocked ] && echo --genlocked) \
                    --out "$STATE/benchmarks-phases-$phases.json" --log-dir "$STATE/logs-phases-$phases"
            done ;;
        ab_head) # ab's second half alone, where its base ran on this machine before (a rerun).
            step ab-head python3 bench/pipeline.py --cameras 32 64 --transports cuda_ipc \
                --source synthetic-replay --warmup-s 5 --measure-s 15 \
                --out "$STATE/benchmarks-ab-head.json" --log-dir "$STATE/logs-head" ;;
        half) # models.half: float32 (the default) against float16 models in the daemon.
            for precision in fp32 fp16; do
                extra=""; [ $precision = fp16 ] && extra="--half"
                step "half-$precision" python3 bench/pipeline.py --cameras 32 64 --transports cuda_ipc \
                    --source synthetic-replay --warmup-s 5 --measure-s 15 $extra \
                    --out "$STATE/benchmarks-pipeline-$precision.json" --log-dir "$STATE/logs-$precision"
            done ;;
        mps_ab) # The daemon without MPS, then under it, one after the other on one machine, at
            # $MPS_AB_CAMERAS (default 64) replayed cameras, no traces (CUPTI's own cost hides
            # what MPS changes: Note [Where the GPU's time goes]).
            if ! command -v nvidia-cuda-mps-control > /dev/null; then
                echo "$(date -u +%H:%M:%S) mps_ab: no nvidia-cuda-mps-control" >> "$STATE/steps.txt"
            else
                for side in without with; do
                    if [ $side = with ]; then
                        mps_start
                    fi
                    step "mps_ab-$side" python3 bench/pipeline.py --cameras ${MPS_AB_CAMERAS:-64} \
                        --transports cuda_ipc --source synthetic-replay --warmup-s 5 --measure-s 15 \
                        --out "$STATE/benchmarks-mps-ab-$side.json" --log-dir "$STATE/logs-mps-ab-$side"
                done
                mps_stop
            fi ;;
        mps) # The same daemon with NVIDIA MPS: the workers' kernels share the GPU at once
            # instead of taking turns by time slice (never tried yet; needs
            # nvidia-cuda-mps-control on the machine).
            if ! command -v nvidia-cuda-mps-control > /dev/null; then
                echo "$(date -u +%H:%M:%S) mps: no nvidia-cuda-mps-control" >> "$STATE/steps.txt"
            else
                mps_start
                step mps python3 bench/pipeline.py --cameras 32 64 --transports cuda_ipc \
                    --source synthetic-replay --warmup-s 5 --measure-s 15 \
                    --out "$STATE/benchmarks-mps.json" --log-dir "$STATE/logs-mps"
                mps_stop
            fi ;;
        gpu_time) # Note [Where the GPU's time goes]: each variant's GPU time by process.
            # $GPU_TIME_VARIANTS: some of them only (MPS's half runs where MPS is installed).
            for variant in ${GPU_TIME_VARIANTS-defaults half one_roi_worker}; do
                extra=""
                [ $variant = half ] && extra="--half"
                [ $variant = one_roi_worker ] && extra="--roi-workers 1"
                step "gpu_time-$variant" python3 bench/pipeline.py --cameras 64 --transports cuda_ipc \
                    --source synthetic-replay --warmup-s 5 --measure-s 15 --gpu-trace-s 3 $extra \
                    --out "$STATE/benchmarks-gpu-time-$variant.json" --log-dir "$STATE/logs-gpu-time-$variant"
            done
            if command -v nvidia-cuda-mps-control > /dev/null; then
                mps_start
                step gpu_time_mps python3 bench/pipeline.py --cameras 64 --transports cuda_ipc \
                    --source synthetic-replay --warmup-s 5 --measure-s 15 --gpu-trace-s 3 \
                    --out "$STATE/benchmarks-gpu-time-mps.json" --log-dir "$STATE/logs-gpu-time-mps"
                mps_stop
            fi
            # The traces (~300 MB at 64 cameras) stay on the machine; the JSON has their sums.
            rm -rf "$STATE"/logs-gpu-time*/gpu-trace-* ;;
        models) step models python3 bench/models.py --batch-sizes 64 --cameras 32 \
            --budget-s 420 --landmarker-task .models/face_landmarker.task \
            --out "$STATE/benchmarks-models.json" ;;
        decode|decode_gpu|decode_cpu)
            # One GPU's table, also on a host of two (Note [Visible GPUs]): the x2 kind can run
            # it in the loan that runs `two_gpus`. $DECODE_CAMERAS (counts) narrows it.
            decoders="gpu cpu"; [ "$name" != decode ] && decoders=${name#decode_}
            for decode in $decoders; do
                CUDA_VISIBLE_DEVICES=0 step "decode-$decode" python3 bench/pipeline.py \
                    --cameras ${DECODE_CAMERAS:-8 16 32 48 64} \
                    --transports cuda_ipc --source synthetic-h264 --decode "$decode" \
                    --warmup-s 4 --measure-s 10 \
                    --out "$STATE/benchmarks-decode-$decode.json" --log-dir "$STATE/logs-decode-$decode"
            done ;;
        decode_profile) step decode_profile python3 bench/pipeline.py --cameras 64 \
            --transports cuda_ipc --source synthetic-h264 --decode gpu --warmup-s 4 \
            --measure-s 10 --profile-roles capture roi_landmark detection \
            --out "$STATE/benchmarks-decode-profile.json" --log-dir "$STATE/logs-decode-profile" ;;
        two_gpus)
            CUDA_VISIBLE_DEVICES=0 step two_gpus-one python3 bench/pipeline.py --cameras 64 \
                --transports cuda_ipc --source synthetic-h264 --decode gpu --warmup-s 4 \
                --measure-s 10 --out "$STATE/benchmarks-two-gpus-one.json" --log-dir "$STATE/logs"
            step two_gpus-both python3 bench/pipeline.py --cameras 128 \
                --transports cuda_ipc --source synthetic-h264 --decode gpu --warmup-s 4 \
                --measure-s 10 --out "$STATE/benchmarks-two-gpus-both.json" \
                --log-dir "$STATE/logs" ;;
        two_gpus_stop) # The 128-camera stop on both GPUs, twice: boot, hold, SIGTERM; each
            # worker's "closed in" line and the supervisor's "ended ... after its SIGTERM" lines
            # in the log say where the stop's time goes (Note [A closed worker is not killed]).
            for round in 1 2; do
                step "two_gpus_stop-$round" python3 bench/pipeline.py --boot-stop-only --cameras 128 \
                    --transports cuda_ipc --source synthetic-h264 --decode gpu --hold-s 8 \
                    --out "$STATE/boot-stop-128-$round.json" --log-dir "$STATE/logs-stop-$round"
            done ;;
        newcomers) step newcomers python3 bench/pipeline.py --newcomers --cameras 8 32 \
            --transports cuda_ipc --source synthetic-replay --warmup-s 5 --measure-s 12 \
            --out "$STATE/benchmarks-newcomers.json" --log-dir "$STATE/logs" ;;
        conv) step conv python3 bench/conv_kernels.py --out "$STATE/conv-kernels.json" ;;
        kernels) if [ -f .footage/kernel_probe.py ]; then
                COMPILE_MODELS=attention step kernels python3 .footage/kernel_probe.py \
                    "$STATE/kernels.jsonl"
            else
                echo "$(date -u +%H:%M:%S) kernels: no .footage/kernel_probe.py" >> "$STATE/steps.txt"
            fi ;;
        roi_workers) # Note [Measuring workers per GPU]: 64 cameras with one roi_landmark
            # worker, then with two (auto), one after the other on this machine.
            for count in 1 2; do
                step "roi-workers-$count" python3 bench/pipeline.py --cameras 64 --roi-workers $count \
                    --transports cuda_ipc --source synthetic-replay --warmup-s 5 --measure-s 15 \
                    --out "$STATE/benchmarks-roi-workers-$count.json" --log-dir "$STATE/logs-roi-$count"
            done ;;
        groups_decode) # Note [Capture groups] for decoded cameras: 64 NVDEC cameras in capture
            # processes of 16 (auto: four a GPU), then of 8, one machine (needs .whl2a/.whl2b);
            # $GROUPS_DECODE (sizes) runs those instead.
            for per_worker in ${GROUPS_DECODE:-auto 8}; do
                step "groups-decode-$per_worker" python3 bench/pipeline.py --cameras 64 \
                    --cameras-per-capture-worker $per_worker --transports cuda_ipc \
                    --source synthetic-h264 --decode gpu --warmup-s 4 --measure-s 10 \
                    --out "$STATE/benchmarks-groups-decode-$per_worker.json" \
                    --log-dir "$STATE/logs-groups-decode-$per_worker"
            done ;;
        detection_share) # Note [Detection while the device has room]: the share's cost to the
            # measuring at 32 and 64 cameras, and its gain for newcomers at 32, one machine.
            for share in 0.5 0.25 0.1; do
                step "share-$share" python3 bench/pipeline.py --cameras 32 64 --detection-share $share \
                    --transports cuda_ipc --source synthetic-replay --warmup-s 5 --measure-s 15 \
                    --out "$STATE/benchmarks-share-$share.json" --log-dir "$STATE/logs-share-$share"
            done
            for share in 0.5 0.25; do
                step "newcomers-share-$share" python3 bench/pipeline.py --newcomers --cameras 32 \
                    --detection-share $share --transports cuda_ipc --source synthetic-replay \
                    --warmup-s 5 --measure-s 12 --out "$STATE/benchmarks-newcomers-share-$share.json" \
                    --log-dir "$STATE/logs-newcomers-$share"
            done ;;
        worker_memory) step worker_memory python3 bench/worker_memory.py --cameras 64 \
            --out "$STATE/benchmarks-worker-memory.json" ;;
        stages) step stages python3 bench/model_stages.py --out "$STATE/benchmarks-model-stages.json" ;;
        analyze) step analyze python3 bench/analyze.py --device cuda --decode gpu \
            --files-at-once 8 --repeats 2 --frames 600 --skip-inline --litert-threads 1 8 \
            --work "$STATE/analyze" --out "$STATE/benchmarks-analyze-gpu.json" --docs '' ;;
        analyze_jobs) step analyze_jobs python3 bench/analyze.py --device cuda --decode gpu \
            --files-at-once 32 --repeats 1 --frames 600 --skip-inline --litert-threads 8 \
            --footage 1920x1080x1 --jobs 1 4 \
            --work "$STATE/analyze" --out "$STATE/benchmarks-analyze-jobs.json" --docs '' ;;
        *) echo "$(date -u +%H:%M:%S) unknown step $name" >> "$STATE/steps.txt" ;;
        esac
    done
    echo "gpu_check: done" >> "$STATE/steps.txt"
    ;;
wait)
    # A machine given back between calls comes back bare: say so at once rather than wait.
    if [ ! -f "$STATE/run.log" ]; then
        echo "gpu_check: no run on this machine (a fresh one: the last was given back)" >&2
        exit 3
    fi
    deadline=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $deadline ] && ! grep -q "gpu_check: done" "$STATE/steps.txt" 2>/dev/null; do
        # A run that died (2026-11-28: a fresh machine without .whl/, its setup failed at once)
        # ends the wait, with its log, rather than hold the machine for nothing.
        if ! kill -0 "$(cat "$STATE/pid" 2>/dev/null)" 2>/dev/null; then
            echo "gpu_check: the run ended early; its log:" >&2
            tail -20 "$STATE/run.log" >&2
            break
        fi
        sleep 5
    done
    # What is there so far, as two files ($OUT brings back at most 8, two folders down): every
    # step's log, JSON and daemon/profile log in one archive, and the step list.
    mkdir -p "$OUT/gpu_check"
    cp "$STATE/steps.txt" "$OUT/gpu_check/" 2>/dev/null
    # Not the private tree, analyze's made footage (111 and 26 MB: over what $OUT brings back)
    # nor the running tests' folders (their daemon logs come once the step ends).
    tar -czf "$OUT/gpu_check/results.tar.gz" -C "$STATE" --exclude=./tree --exclude=./analyze \
        --exclude=./pytest-tmp . 2>/dev/null
    cat "$STATE/steps.txt"
    ;;
*)
    echo "usage: $0 start [STEP...] | wait [SECONDS]" >&2
    exit 2
    ;;
esac
