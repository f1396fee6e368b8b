"""GPU memory of the inference workers' pipelines, built as the workers build them, and what a warm
spare's promotion costs.

    python bench/worker_memory.py --cameras 64 --out memory.json      # on a GPU

On the offline GPU host: `bash bench/gpu_check.sh start worker_memory`.

What is measured
----------------
For each case (role, the config's cameras, the most cameras one worker of the role has: the
Assignment's `most_cameras`, Note [Warmed for the largest share]), in a
process of its own (a fresh CUDA context, the allocator as workers set it: expandable segments,
Note [Expandable segments]), with 1920x1080 synthetic cameras and the default config otherwise:
1. `prepare_pipelines`, as a warm spare prepares (every batch shape warmed, then the CUDA graphs
   dropped: Note [Spares without graphs]): the spare's memory;
2. `pipelines_for` on those pipelines, as the promoted spare's boot: the graphs captured again
   (seconds: the promotion's added cost) and the worker's memory at its first batch;
3. `pipelines_for` once more, with the graphs there: what warm-up costs when nothing is new.
Memory: torch's allocated, reserved (its caching allocator, graph pools included) and peak
allocated, and the process's GPU memory as NVML counts it (daemon/gpu_monitor.py, as `facecast
status` does: the CUDA context too), in MiB. A worker in the daemon holds more once running
(its eager passes' cache: the frames it reads, the crops); `bench/pipeline.py` reports that per
role (`torch_memory_mib_by_role`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure_case(role: str, cameras: int, most_cameras: int, model_dir: str) -> dict:
    """One case, in this process (see the module's docstring)."""
    import msgspec
    import torch

    from facecast.daemon.gpu_monitor import GpuMonitor
    from facecast.shared import config as config_mod
    from facecast.workers.inference import pipelines

    gpus = GpuMonitor()  # NVML, as `facecast status` counts each worker's memory

    def memory() -> dict:
        torch.cuda.synchronize()
        return {"allocated_mib": torch.cuda.memory_allocated() >> 20,
                "reserved_mib": torch.cuda.memory_reserved() >> 20,
                "peak_allocated_mib": torch.cuda.max_memory_allocated() >> 20,
                "nvml_mib": gpus.memory_by_pid().get(os.getpid(), -1)}

    camera_list = [{"id": f"c{k}", "source": "synthetic-replay", "width": 1920, "height": 1080}
                   for k in range(cameras)]
    config = msgspec.convert({"models": {"dir": model_dir}, "cameras": camera_list}, config_mod.Config)
    device = pipelines.torch_device("cuda:0")
    torch.zeros(1, device=device)
    row = {"role": role, "cameras": cameras, "most_cameras": most_cameras,
           "context": memory()}
    options = {"blendshapes": role == "roi_landmark", "pose": False, "most_cameras": most_cameras}
    started = time.perf_counter()
    prepared = pipelines.prepare_pipelines(config, device, **options)
    row["spare_prepare_s"] = round(time.perf_counter() - started, 2)
    row["spare"] = memory()
    started = time.perf_counter()
    face = pipelines.pipelines_for(prepared, config, device, **options).face
    row["promotion_capture_s"] = round(time.perf_counter() - started, 3)
    row["promoted"] = memory()
    row["graphs"] = len(face.graphs.captured)
    row["graph_fallbacks"] = face.graph_fallbacks
    started = time.perf_counter()
    pipelines.pipelines_for(prepared, config, device, **options)
    row["warm_up_again_s"] = round(time.perf_counter() - started, 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cameras", type=int, default=64)
    parser.add_argument("--model-dir", default=str(REPO / ".models"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--case", nargs=3, metavar=("ROLE", "CAMERAS", "MOST_CAMERAS"),
                        help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        role, cameras, most = args.case
        print(json.dumps(measure_case(role, int(cameras), int(most), args.model_dir)))
        return 0
    half = (args.cameras + 1) // 2
    cases = [("detection", args.cameras, args.cameras),
             ("roi_landmark", args.cameras, half),  # two workers' share (auto at 64 cameras)
             ("roi_landmark", args.cameras, args.cameras)]  # what every worker warmed before
    environment = dict(os.environ)
    environment.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rows = []
    for role, cameras, most in cases:
        done = subprocess.run([sys.executable, __file__, "--model-dir", args.model_dir,
                               "--case", role, str(cameras), str(most)],
                              capture_output=True, text=True, env=environment)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        row = rows[-1]
        print(f"{role:13} cameras {cameras:3} warmed for {most:3}: spare {row['spare']['nvml_mib']:6} MiB"
              f" (torch {row['spare']['reserved_mib']} held), promoted {row['promoted']['nvml_mib']:6} MiB"
              f" (torch {row['promoted']['reserved_mib']} held, {row['graphs']} graphs captured in"
              f" {row['promotion_capture_s']:.2f} s), again {row['warm_up_again_s']:.2f} s", flush=True)
    if args.out:
        import torch

        args.out.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "allocator": environment["PYTORCH_CUDA_ALLOC_CONF"], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
