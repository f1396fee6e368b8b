"""`facecast cameras`: the video devices of this machine and what they can capture, and
`facecast cameras --probe URL`: whether a stream or file opens, as a capture worker opens it.

Runs on the CLI side, never through a running daemon (a device that the daemon holds may show as
busy). What it prints is what a `[[cameras]]` table needs: a `source` (the stable
/dev/v4l/by-id/ path where there is one), and the pixel formats (`fourcc`), sizes and frame
rates the device offers.

How the devices are read, best first (the output names the method):

- `v4l2-ctl` (Debian's v4l-utils), when installed: the driver's own answers to the V4L2 ioctls
  (VIDIOC_QUERYCAP, VIDIOC_ENUM_FMT, ..._FRAMESIZES, ..._FRAMEINTERVALS): name, driver, every
  capture mode. facecast does not issue these ioctls itself: the PyPI packages that wrap them
  are GPL-licensed (linuxpy, v4l2-python3) or unmaintained, and facecast is Apache-2.0.
- OpenCV otherwise: the name from sysfs, and the one mode the driver is set to now (OpenCV
  cannot list modes).

`--probe` takes the source exactly as `[[cameras]].source` does and goes through
facecast.workers.capture.sources.open_source, the capture worker's own code, with a timeout.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from facecast.daemon.cli.streams import positive_seconds
from facecast.shared.config import CameraConfig, redact_url

log = logging.getLogger(__name__)

DEV_DIR = Path("/dev")
BY_ID_DIR = Path("/dev/v4l/by-id")
SYSFS_DIR = Path("/sys/class/video4linux")
V4L2_CTL_TIMEOUT_S = 10.0
DEFAULT_PROBE_TIMEOUT_S = 10.0

# struct v4l2_capability's device_caps bits (linux/videodev2.h): a node that can capture video.
V4L2_CAP_VIDEO_CAPTURE = 0x00000001
V4L2_CAP_VIDEO_CAPTURE_MPLANE = 0x00001000


@dataclass
class CaptureFormat:
    fourcc: str  # e.g. "MJPG", what `[[cameras]].fourcc` takes
    description: str  # the driver's words, e.g. "Motion-JPEG, compressed"
    modes: list[str] = field(default_factory=list)  # "1920x1080 @ 30, 15 fps"


@dataclass
class VideoDevice:
    path: Path
    name: str = ""
    driver: str = ""
    bus: str = ""
    stable_paths: list[Path] = field(default_factory=list)  # /dev/v4l/by-id/... links to it
    captures_video: bool | None = None  # None: unknown (OpenCV cannot tell)
    formats: list[CaptureFormat] = field(default_factory=list)
    problem: str = ""


def video_device_paths(dev_dir: Path = DEV_DIR) -> list[Path]:
    """/dev/video* in numeric order (video2 before video10)."""
    def index(path: Path) -> int:
        digits = path.name.removeprefix("video")
        return int(digits) if digits.isdigit() else 1 << 30
    return sorted(dev_dir.glob("video*"), key=lambda path: (index(path), path.name))


def _stable_paths(path: Path, by_id_dir: Path = BY_ID_DIR) -> list[Path]:
    if not by_id_dir.is_dir():
        return []
    return sorted(link for link in by_id_dir.iterdir() if link.resolve() == path.resolve())


# --- v4l2-ctl -------------------------------------------------------------------------------------

_INFO_FIELD = re.compile(r"^\s+(Driver name|Card type|Bus info|Device Caps)\s*:\s*(.*)$")
_FORMAT = re.compile(r"^\s*\[\d+\]: '(?P<fourcc>[^']*)' \((?P<description>.*)\)\s*$")
_SIZE = re.compile(r"^\s*Size: (?P<kind>\w+) (?P<size>.*?)\s*$")
_DISCRETE_FPS = re.compile(r"^\s*Interval: Discrete [\d.]+s \((?P<fps>[\d.]+) fps\)")
_RANGE_FPS = re.compile(r"^\s*Interval: (?:Continuous|Stepwise) .*\((?P<fps>[\d.]+-[\d.]+) fps\)")


def parse_v4l2_ctl(text: str, device: VideoDevice) -> VideoDevice:
    """Fill `device` from `v4l2-ctl --info --list-formats-ext` output (v4l-utils' own format,
    utils/v4l2-ctl/v4l2-ctl.cpp: print_video_formats_ext, print_frmsize, print_frmival)."""
    current_format: CaptureFormat | None = None
    size = ""
    rates: list[str] = []

    def close_size() -> None:
        nonlocal size, rates
        if current_format is not None and size:
            current_format.modes.append(f"{size} @ {', '.join(rates)} fps" if rates else size)
        size, rates = "", []

    for line in text.splitlines():
        info = _INFO_FIELD.match(line)
        if info:
            key, value = info.groups()
            if key == "Driver name":
                device.driver = value
            elif key == "Card type":
                device.name = value
            elif key == "Bus info":
                device.bus = value
            else:
                caps = int(value, 16)
                device.captures_video = bool(
                    caps & (V4L2_CAP_VIDEO_CAPTURE | V4L2_CAP_VIDEO_CAPTURE_MPLANE))
            continue
        fmt = _FORMAT.match(line)
        if fmt:
            close_size()
            current_format = CaptureFormat(fmt["fourcc"].strip(), fmt["description"])
            device.formats.append(current_format)
            continue
        found_size = _SIZE.match(line)
        if found_size:
            close_size()
            size = found_size["size"]
            if found_size["kind"] != "Discrete":
                size = f"{found_size['kind'].lower()} {size}"
            continue
        rate = _DISCRETE_FPS.match(line) or _RANGE_FPS.match(line)
        if rate:
            rates.append(f"{float(rate['fps']):g}" if "-" not in rate["fps"] else rate["fps"])
    close_size()
    return device


def _describe_with_v4l2_ctl(v4l2_ctl: str, device: VideoDevice) -> VideoDevice:
    try:
        done = subprocess.run([v4l2_ctl, "-d", str(device.path), "--info", "--list-formats-ext"],
                              capture_output=True, text=True, timeout=V4L2_CTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        device.problem = f"v4l2-ctl did not answer within {V4L2_CTL_TIMEOUT_S:g} s"
        return device
    if done.returncode != 0:
        device.problem = (done.stderr.strip() or done.stdout.strip()
                          or f"v4l2-ctl exited with {done.returncode}")
        return device
    return parse_v4l2_ctl(done.stdout, device)


# --- OpenCV ---------------------------------------------------------------------------------------


def _describe_with_opencv(device: VideoDevice) -> VideoDevice:
    import cv2

    from facecast.workers.capture.sources import fourcc_text

    try:
        device.name = (SYSFS_DIR / device.path.name / "name").read_text().strip()
    except OSError:
        pass
    capture = cv2.VideoCapture(str(device.path), cv2.CAP_V4L2)
    try:
        if not capture.isOpened():
            device.problem = ("OpenCV cannot open it (busy, not a capture node, or not readable: "
                              "is this user in group 'video'?)")
            return device
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        fps = capture.get(cv2.CAP_PROP_FPS)
        fourcc = fourcc_text(capture.get(cv2.CAP_PROP_FOURCC))
        device.formats.append(CaptureFormat(
            fourcc or "?", "the mode the driver is set to now; OpenCV cannot list the others",
            [f"{width}x{height} @ {fps:g} fps"]))
    finally:
        capture.release()
    return device


# --- the listing ----------------------------------------------------------------------------------


def list_devices(dev_dir: Path = DEV_DIR) -> tuple[str, list[VideoDevice]]:
    """(the method used, every /dev/video* described with it)."""
    v4l2_ctl = shutil.which("v4l2-ctl")
    method = ("v4l2-ctl (v4l-utils): every capture mode the driver lists" if v4l2_ctl else
              "OpenCV (v4l2-ctl not installed): the current mode only; for every mode, install "
              "v4l-utils (Debian: apt-get install v4l-utils)")
    devices = []
    for path in video_device_paths(dev_dir):
        device = VideoDevice(path, stable_paths=_stable_paths(path))
        devices.append(_describe_with_v4l2_ctl(v4l2_ctl, device) if v4l2_ctl
                       else _describe_with_opencv(device))
    return method, devices


def format_devices(method: str, devices: list[VideoDevice]) -> str:
    lines = [f"method: {method}"]
    for device in devices:
        about = ", ".join(part for part in (device.driver, device.bus) if part)
        head = f"{device.path}  {device.name or '(no name)'}" + (f" ({about})" if about else "")
        lines.append(head)
        for stable in device.stable_paths:
            lines.append(f"    source = \"{stable}\"  (survives re-plugging)")
        if device.problem:
            lines.append(f"    cannot read it: {device.problem}")
        elif device.captures_video is False:
            lines.append("    not a video capture node (e.g. a UVC camera's metadata node): "
                         "not a source")
        for fmt in device.formats:
            lines.append(f"    fourcc {fmt.fourcc!r} ({fmt.description})")
            lines += [f"        {mode}" for mode in fmt.modes]
    return "\n".join(lines)


# --- probe ----------------------------------------------------------------------------------------


def probe(source: str, timeout_s: float) -> tuple[bool, str]:
    """(ok, one line): open `source` like a capture worker and read one frame within `timeout_s`."""
    from facecast.workers.capture.sources import SourceConfigError, SourceLost, open_source

    shown = redact_url(source)
    camera = CameraConfig(id="probe", source=source)
    outcome: dict[str, object] = {}
    started_monotonic = time.monotonic()

    def open_and_read() -> None:
        try:
            with open_source(camera, open_timeout_s=timeout_s, read_timeout_s=timeout_s) as opened:
                frame, _ = opened.read()
                outcome["granted"], outcome["shape"] = opened.granted, frame.shape
        except (SourceLost, SourceConfigError) as exc:
            outcome["error"] = getattr(exc, "reason", str(exc))

    # A driver can hang in a read that has no timeout of its own (V4L2): the probe still ends.
    reader = threading.Thread(target=open_and_read, name="probe", daemon=True)
    reader.start()
    reader.join(2 * timeout_s + 1.0)
    took_s = time.monotonic() - started_monotonic
    if reader.is_alive():
        return False, f"{shown}: no frame within {took_s:.0f} s (the source hangs)"
    if "error" in outcome:
        return False, f"{shown}: cannot be read: {redact_url(str(outcome['error']))}"
    granted = outcome["granted"]
    height_px, width_px = outcome["shape"][:2]
    codec = f"codec {granted.fourcc}" if granted.fourcc else "codec unknown"
    return True, (f"{shown}: ok, {codec}, {width_px}x{height_px} @ {granted.fps:g} fps "
                  f"({granted.backend}); first frame after {took_s:.2f} s")


# --- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--probe", metavar="SOURCE",
                        help="open an rtsp://, http:// URL or a video file (any camera source) "
                        "as a capture worker would and read one frame; exit 1 if that fails")
    parser.add_argument("--timeout", metavar="S", type=positive_seconds,
                        default=DEFAULT_PROBE_TIMEOUT_S,
                        help="--probe: seconds to open the source and to read a frame "
                        "(default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    if args.probe is not None:
        ok, line = probe(args.probe, args.timeout)
        print(line)
        return 0 if ok else 1
    method, devices = list_devices()
    if not devices:
        print(f"no V4L2 video devices found: nothing matches {DEV_DIR}/video* on this machine "
              "(no camera plugged in, or no driver for it). A network camera or a video file: "
              "facecast cameras --probe SOURCE")
        return 1
    print(format_devices(method, devices))
    return 0
