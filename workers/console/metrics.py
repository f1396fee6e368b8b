"""The web console's Prometheus metrics (`GET /metrics`): the supervisor's last `DaemonStatus`,
the one `facecast status` prints, in Prometheus's text format (prometheus-client writes it).

Runs in the console worker only, for the HTTP handler in facecast.workers.console.http.

Note [Metrics from the status]
    The metrics are a view of the status the console already asks the supervisor for once a
    second, not a second set of counters kept in the workers: what a scrape shows is exactly what
    `facecast status` and the console's page show, and no worker gains work or a port. A scrape
    reads the newest status the console holds; `facecast_status_age_seconds` says how old it is
    (a supervisor that stopped answering shows as a growing age, not as frozen numbers taken for
    live ones). Before the first status, `/metrics` answers 503, which Prometheus records as a
    failed scrape.

    The latencies are what the workers measure: p50 and p99 over each stage's window of its last
    LATENCY_WINDOW values (facecast.shared.stats.LatencyWindow), and how many values it took
    since the worker started. The daemon keeps no buckets and no sum, so there is no histogram
    here and no summary (a summary's `_sum` would be invented): the quantiles are gauges with a
    `quantile` label, and the count is a counter. Counters (`_total`) are the workers' own
    totals since they (re)started; Prometheus's rate() handles the reset after a restart.
    Names follow Prometheus's conventions: the `facecast_` prefix, base units (seconds, bytes,
    ratios rather than percent), `_total` for counters.
"""

from __future__ import annotations

import inspect

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from facecast.shared.stats import LatencyWindow

# WorkerStatus.state's values (facecast.shared.transport.messages): each worker has one series per state,
# 1 for the one it is in (Prometheus's way of showing an enum).
WORKER_STATES = ("booting", "running", "standby", "backoff", "pending", "failed", "flapping",
                 "stopped")
MIB_BYTES = 1024 * 1024
# The window the workers' quantiles are taken over (LatencyWindow's default, which every stage
# and the output worker's latency use), for the metrics' help texts.
LATENCY_WINDOW = inspect.signature(LatencyWindow).parameters["size"].default


def render(status: dict, status_age_s: float) -> bytes:
    """The metrics text of a DaemonStatus (as JSON builtins) received `status_age_s` ago."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(status, status_age_s))
    return generate_latest(registry)


class _StatusCollector:
    """A prometheus-client custom collector over one status (Note [Metrics from the status])."""

    def __init__(self, status: dict, status_age_s: float) -> None:
        self.status = status
        self.status_age_s = status_age_s

    def collect(self):
        status = self.status
        yield from self._daemon(status)
        yield from self._workers(status["workers"])
        yield from self._cameras(status["cameras"])
        yield from self._stages(status["stages"])
        yield from self._gpus(status.get("gpus", []))

    def _daemon(self, status: dict):
        ready = GaugeMetricFamily("facecast_ready", "1 once the daemon has sent READY=1")
        ready.add_metric([], 1.0 if status["ready"] else 0.0)
        uptime = GaugeMetricFamily("facecast_uptime_seconds", "Seconds since the supervisor started")
        uptime.add_metric([], status["uptime_s"])
        age = GaugeMetricFamily(
            "facecast_status_age_seconds",
            "Seconds since the console received the supervisor's status these metrics show")
        age.add_metric([], self.status_age_s)
        rejected = CounterMetricFamily(
            "facecast_control_rejected_messages",
            "Malformed messages the supervisor's control socket refused")
        rejected.add_metric([], status.get("rejected_messages", 0))
        return [ready, uptime, age, rejected]

    def _workers(self, workers: list[dict]):
        labels = ["worker", "role", "spare"]
        state = GaugeMetricFamily(
            "facecast_worker_state",
            f"1 for the state each worker is in ({', '.join(WORKER_STATES)}), 0 for the others; "
            "spare=\"true\": a warm standby", labels=labels + ["state"])
        restarts = CounterMetricFamily(
            "facecast_worker_restarts", "Times the supervisor restarted the worker",
            labels=labels)
        uptime = GaugeMetricFamily("facecast_worker_uptime_seconds",
                                   "Seconds since the worker's process started", labels=labels)
        rejected = CounterMetricFamily(
            "facecast_worker_rejected_messages",
            "Malformed messages the worker's sockets refused since it (re)started", labels=labels)
        for worker in workers:
            values = [worker["name"], worker["role"], str(worker.get("standby", False)).lower()]
            for name in WORKER_STATES:
                state.add_metric(values + [name], 1.0 if worker["state"] == name else 0.0)
            restarts.add_metric(values, worker["restarts"])
            uptime.add_metric(values, worker["uptime_s"])
            rejected.add_metric(values, worker.get("rejected_messages", 0))
        return [state, restarts, uptime, rejected]

    def _cameras(self, cameras: dict[str, list[dict]]):
        # A camera's reports come one per worker that sees it, without the worker's name; each
        # is told by what it carries, as `facecast status` tells them (daemon/cli/status.py):
        # capture's has `source`, output's `latency_ms`, a recorder's `recording`, and the frame
        # consumers' (detection, landmarks, console) `transport` alone.
        labels = ["camera"]
        captured_fps = GaugeMetricFamily(
            "facecast_camera_captured_frames_per_second",
            "Frames a second the camera's capture worker read, over its last heartbeat window",
            labels=labels)
        published_fps = GaugeMetricFamily(
            "facecast_camera_published_frames_per_second",
            "Frames a second the output worker published on LSL for the camera, over its last "
            "heartbeat window", labels=labels)
        captured = CounterMetricFamily(
            "facecast_camera_captured_frames",
            "Frames the camera's capture worker read since it (re)started", labels=labels)
        published = CounterMetricFamily(
            "facecast_camera_published_frames",
            "Frames of the camera the output worker published since it (re)started",
            labels=labels)
        skipped = CounterMetricFamily(
            "facecast_camera_frames_skipped",
            "Frames of the camera that its frame consumers never got to (newest-frame policy: "
            "busy when they came), added up over the consumers, each since it (re)started",
            labels=labels)
        mismatches = CounterMetricFamily(
            "facecast_camera_checksum_mismatches",
            "Ring slots whose bytes were not the frame published in them, over the camera's "
            "frame consumers", labels=labels)
        faces = GaugeMetricFamily("facecast_camera_faces",
                                  "Faces in the camera's newest published frame", labels=labels)
        source_ok = GaugeMetricFamily(
            "facecast_camera_source_ok",
            "1 while the camera's source delivers frames; the source label says its state",
            labels=["camera", "source"])
        transport = GaugeMetricFamily(
            "facecast_camera_transport_fallback",
            "1 when the camera's frames travel on shared memory although CUDA IPC was asked for "
            "(the reason label says why), else 0", labels=["camera", "transport", "reason"])
        latency = GaugeMetricFamily(
            "facecast_camera_capture_to_lsl_seconds",
            f"Capture -> LSL push latency of the camera's samples: p50 and p99 over the output "
            f"worker's last {LATENCY_WINDOW} pushes (the daemon keeps quantiles, not buckets)",
            labels=["camera", "quantile"])
        latency_count = CounterMetricFamily(
            "facecast_camera_capture_to_lsl_samples",
            "Pushes the capture -> LSL latency was measured on since the output worker "
            "(re)started", labels=labels)
        recording_drops = CounterMetricFamily(
            "facecast_camera_recording_dropped_frames",
            "Frames captured during the camera's current (or last) recording that are not in "
            "its video", labels=labels)
        for camera_id, reports in cameras.items():
            capture = next((r for r in reports if r.get("source")), None)
            output = next((r for r in reports if r.get("latency_ms") is not None), None)
            recorder = next((r for r in reports if r.get("recording")), None)
            consumers = [r for r in reports if r.get("transport") and not r.get("source")]
            skipped.add_metric([camera_id], sum(r.get("skipped", 0) for r in consumers))
            mismatches.add_metric([camera_id],
                                  sum(r.get("checksum_mismatches", 0) for r in consumers))
            if capture is not None:
                captured_fps.add_metric([camera_id], capture.get("fps", 0.0))
                captured.add_metric([camera_id], capture.get("frames", 0))
                source_ok.add_metric([camera_id, capture["source"]],
                                     1.0 if capture["source"] == "ok" else 0.0)
                reason = capture.get("fallback_reason", "")
                transport.add_metric([camera_id, capture.get("transport", ""), reason],
                                     1.0 if reason else 0.0)
            if output is not None:
                published_fps.add_metric([camera_id], output.get("fps", 0.0))
                published.add_metric([camera_id], output.get("frames", 0))
                faces.add_metric([camera_id], output.get("faces", 0))
                timing = output["latency_ms"]
                latency.add_metric([camera_id, "0.5"], timing["p50_ms"] / 1e3)
                latency.add_metric([camera_id, "0.99"], timing["p99_ms"] / 1e3)
                latency_count.add_metric([camera_id], timing["count"])
            if recorder is not None:
                recording_drops.add_metric([camera_id], recorder.get("recording_drops", 0))
        return [captured_fps, published_fps, captured, published, skipped, mismatches, faces,
                source_ok, transport, latency, latency_count, recording_drops]

    def _stages(self, stages: dict[str, dict]):
        duration = GaugeMetricFamily(
            "facecast_stage_duration_seconds",
            f"Time a worker's stage takes: p50 and p99 over its last {LATENCY_WINDOW} runs "
            "(the daemon keeps quantiles, not buckets); stage is <worker>/<stage>",
            labels=["stage", "quantile"])
        runs = CounterMetricFamily("facecast_stage_runs",
                                   "Runs the stage's timing was measured on since its worker "
                                   "(re)started", labels=["stage"])
        for name, timing in stages.items():
            duration.add_metric([name, "0.5"], timing["p50_ms"] / 1e3)
            duration.add_metric([name, "0.99"], timing["p99_ms"] / 1e3)
            runs.add_metric([name], timing["count"])
        return [duration, runs]

    def _gpus(self, gpus: list[dict]):
        labels = ["gpu", "name"]
        used = GaugeMetricFamily("facecast_gpu_memory_used_bytes",
                                 "GPU memory in use, every process (NVML)", labels=labels)
        total = GaugeMetricFamily("facecast_gpu_memory_total_bytes", "GPU memory (NVML)",
                                  labels=labels)
        busy = GaugeMetricFamily(
            "facecast_gpu_utilization_ratio",
            "Share of the last sample period during which a kernel ran on the GPU (NVML), 0-1",
            labels=labels)
        for gpu in gpus:
            values = [str(gpu["index"]), gpu["name"]]
            used.add_metric(values, gpu["memory_used_mib"] * MIB_BYTES)
            total.add_metric(values, gpu["memory_total_mib"] * MIB_BYTES)
            busy.add_metric(values, gpu["utilization_pct"] / 100.0)
        return [used, total, busy]
