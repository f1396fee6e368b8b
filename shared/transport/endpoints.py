"""Where every ZeroMQ socket of a running daemon lives: `ipc://` paths under the runtime
directory (DESIGN §1). One place, so that the supervisor, the workers and the CLI agree.

ipc:// paths must stay under ~107 bytes (sockaddr_un): names here are short on purpose.
"""

from __future__ import annotations

from pathlib import Path


def control(runtime_dir: str | Path) -> str:
    """Supervisor ROUTER: workers' hello/heartbeats/events, the CLI's status/reload/stop."""
    return f"ipc://{runtime_dir}/control"


def frames(runtime_dir: str | Path, camera_id: str) -> str:
    """Capture PUB → frame consumers: RingDescription and FrameReady of one camera."""
    return f"ipc://{runtime_dir}/frames-{camera_id}"


def ring_control(runtime_dir: str | Path, camera_id: str) -> str:
    """Capture ROUTER ← consumers' DEALER: DescribeRing, TransportFault."""
    return f"ipc://{runtime_dir}/ring-{camera_id}"


def detections(runtime_dir: str | Path, device: str) -> str:
    """Detection worker of one device PUB → roi_landmark workers: Detections (topic: camera)."""
    return f"ipc://{runtime_dir}/detections-{device.replace(':', '')}"


def detection_requests(runtime_dir: str | Path, device: str) -> str:
    """roi_landmark workers PUSH → the device's detection worker PULL: DetectionWanted,
    MeasuringBehind, TracksFull."""
    return f"ipc://{runtime_dir}/detect-requests-{device.replace(':', '')}"


def results(runtime_dir: str | Path) -> str:
    """roi_landmark workers PUB (connect) → output worker SUB (bind): FaceResults."""
    return f"ipc://{runtime_dir}/results"


def results_tap(runtime_dir: str | Path) -> str:
    """Output worker PUB (bind) → web console SUB: every FaceResults the output worker received,
    passed on as it came (Note [Results tap])."""
    return f"ipc://{runtime_dir}/results-tap"


def socket_path(endpoint: str) -> Path:
    return Path(endpoint.removeprefix("ipc://"))
