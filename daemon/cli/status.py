"""`facecast status`, `facecast reload`, `facecast stop`: ask the running daemon (CLI side)."""

from __future__ import annotations

import sys

from facecast.daemon.cli.control_client import NotRunning, request, runtime_dir_of
from facecast.shared import config as config_mod
from facecast.shared.transport.messages import (
    DaemonStatus,
    ReloadRequest,
    StatusRequest,
    StopRequest,
    TorchMemory,
)

TORCH_HEADING = "torch MiB used/held"


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="the daemon's config file (to find its runtime dir)")
    parser.add_argument("--runtime-dir", default="", help="the daemon's runtime directory")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S")


def _runtime_dir(args):
    config = config_mod.load(args.config) if args.config else None
    return runtime_dir_of(config, args.runtime_dir)


def _ask(args, message):
    try:
        return request(_runtime_dir(args), message, args.timeout)
    except config_mod.ConfigError as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except NotRunning as exc:
        print(f"facecast: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def status_main(args) -> int:
    print(render(_ask(args, StatusRequest())))
    line = console_line(_runtime_dir(args))
    if line:
        print(line)
    return 0


def console_line(runtime_dir) -> str:
    """Where the web console answers (its worker writes web-console.json when it listens)."""
    from facecast.workers.console.worker import read_console_file

    console = read_console_file(runtime_dir)
    if console is None:
        return ""
    access = ("every request needs the token" if console.get("token_required")
              else "control with the token" if console.get("allow_control") else "read-only")
    token = f"; token in {console['token_file']}" if console.get("token_file") and (
        console.get("token_required") or console.get("allow_control")) else ""
    return f"web console: {console['url']} ({access}{token})"


def reload_main(args) -> int:
    reply = _ask(args, ReloadRequest())
    if reply.ok:
        print("reloaded")
        return 0
    print(f"facecast: reload refused, the running config stays: {reply.error}", file=sys.stderr)
    return 2


def stop_main(args) -> int:
    _ask(args, StopRequest())
    print("stopping")
    return 0


def render(status: DaemonStatus) -> str:
    """One screen: what it is doing and why (STYLE §12)."""
    lines = [f"facecast daemon pid {status.pid}, up {status.uptime_s:.0f} s, "
             f"{'ready' if status.ready else 'starting'}, config {status.config_path}", ""]
    on_gpu = any(w.gpu_memory_mib is not None for w in status.workers)
    gpu_heading = f" {'GPU MiB':>8}" if on_gpu else ""
    with_torch = any(w.torch_memory is not None for w in status.workers)
    if with_torch:
        gpu_heading += f" {TORCH_HEADING}"
    lines.append(f"{'worker':<28} {'state':<10} {'pid':>7} {'restarts':>8} {'uptime':>8}"
                 f"{gpu_heading}  detail")
    for w in status.workers:
        detail = w.detail or (f"last: {w.last_exit}" if w.last_exit else "")
        if w.rejected_messages:
            detail += f"{'; ' if detail else ''}{w.rejected_messages} malformed message(s) dropped"
        gpu = (f" {w.gpu_memory_mib if w.gpu_memory_mib is not None else '-':>8}" if on_gpu
               else "")
        if with_torch:
            gpu += f" {_torch_cell(w.torch_memory):>{len(TORCH_HEADING)}}"
        lines.append(f"{w.name:<28} {w.state:<10} {w.pid:>7} {w.restarts:>8} "
                     f"{w.uptime_s:>7.0f}s{gpu}  {detail}")
    if status.face_models:
        lines.append(f"face models: {status.face_models}")
    if status.participants:
        lines.append(f"participants: {status.participants}")
    if status.rejected_messages:
        lines.append(f"control socket: {status.rejected_messages} malformed message(s) dropped")
    lines += ["", f"{'camera':<12} {'captured':>9} {'published':>9} {'faces':>5} "
              f"{'transport':<9} {'latency p50/p99':>16}  source / fallback reason"]
    for camera_id, reports in status.cameras.items():
        capture = next((r for r in reports if r.source), None)
        output = next((r for r in reports if r.latency_ms is not None), None)
        consumer = next((r for r in reports if r.transport and not r.source), None)
        latency = (f"{output.latency_ms.p50_ms:.0f}/{output.latency_ms.p99_ms:.0f} ms"
                   if output else "-")
        transport = (capture.transport if capture else "") or "-"
        why = capture.fallback_reason if capture else ""
        source = capture.source if capture else _not_captured(status, camera_id)
        skipped = f", skipped {consumer.skipped}" if consumer and consumer.skipped else ""
        # The decoder (Note [Decoder choice]) of a camera with compressed video.
        decoder = capture.decoder if capture else ""
        decoded = f"; decoder {decoder}: {capture.decode_reason}" if decoder else ""
        lines.append(
            f"{camera_id:<12} {(capture.fps if capture else 0):>7.1f}/s "
            f"{(output.fps if output else 0):>7.1f}/s {(output.faces if output else 0):>5} "
            f"{transport:<9} {latency:>16}  {source}{skipped}{'; ' + why if why else ''}"
            f"{decoded}")
    recordings = [(camera_id, r) for camera_id, reports in status.cameras.items()
                  for r in reports if r.recording]
    if recordings:  # the recorders' cameras (README "Recording")
        lines += ["", f"{'recording':<12} {'frames':>8} {'drops':>6}  state / file"]
        for camera_id, r in recordings:
            where = f"  {r.recording_file}" if r.recording_file else ""
            lines.append(f"{camera_id:<12} {r.recorded_frames:>8} {r.recording_drops:>6}  "
                         f"{r.recording}{where}")
    stages = {name: t for name, t in status.stages.items() if "/hop " not in name}
    hops = {name.split("/", 1)[1]: t for name, t in status.stages.items() if "/hop " in name}
    if stages:
        lines += ["", f"{'stage':<40} {'p50 ms':>8} {'p99 ms':>8} {'count':>8}"]
        for name, timing in sorted(stages.items()):
            lines.append(f"{name:<40} {timing.p50_ms:>8.1f} {timing.p99_ms:>8.1f} {timing.count:>8}")
    if hops:  # Note [Latency accounted]: the same frames in every hop, so the means add up
        lines += ["", f"{'a frame, grab to LSL push':<40} {'mean ms':>8} {'p99 ms':>8} {'frames':>8}"]
        for name, timing in sorted(hops.items()):
            lines.append(f"{name:<40} {timing.mean_ms or 0:>8.1f} {timing.p99_ms:>8.1f} "
                         f"{timing.count:>8}")
    lines.append("")
    if status.gpus:
        for gpu in status.gpus:
            lines.append(f"GPU {gpu.index} {gpu.name}: {gpu.memory_used_mib:.0f}/"
                         f"{gpu.memory_total_mib:.0f} MiB, {gpu.utilization_pct:.0f}% busy")
    else:
        lines.append(f"GPU: none ({status.gpu_note or 'no NVIDIA GPU'})")
    if status.recent_events:
        lines += ["", "recent events:"] + [f"  {e}" for e in status.recent_events]
    return "\n".join(lines)


def _torch_cell(memory: TorchMemory | None) -> str:
    """torch's MiB in live tensors / held by its allocator (`812/1024`), next to NVML's GPU MiB:
    NVML's minus the held is the CUDA context and what torch does not allocate. '-': no CUDA in
    that worker's torch."""
    if memory is None:
        return "-"
    return f"{memory.allocated_mib:.0f}/{memory.reserved_mib:.0f}"


def _not_captured(status: DaemonStatus, camera_id: str) -> str:
    """A camera with no capture report: its capture worker's give-up, when that names it (a
    source that can never work: Note [Sources that can never work])."""
    for w in status.workers:
        if w.role == "capture" and w.state in ("failed", "flapping") and (
                f"camera {camera_id}:" in w.detail or w.name == f"capture:{camera_id}"):
            return f"not captured: {w.name} {w.state} (above)"
    return "?"
