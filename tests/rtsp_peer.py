"""A real RTSP camera on loopback for the tests: GStreamer's RTSP server, run by a Python that has
PyGObject and GstRtspServer (the system one, usually), in its own process so that it can be
killed and started again on the same port (a camera that goes away and comes back).

Used by tests/test_sources.py and tests/soak. Where the server is not installed, `gst_python()`
is None and `MISSING_REASON` says what to install; tests skip with it.

ffmpeg cannot be this peer: its RTSP muxer only pushes (ANNOUNCE/RECORD), and
`-rtsp_flags listen` exists only on its demuxer.

An H.264 camera has a second server: the `rtsp` package's (PyPI `rtsp`, the `test` extra: its
RTSP sessions and RTP packets in Python, the frames encoded by PyAV's libx264), in this
interpreter. The GPU machine has no GStreamer for its Python, so that is how its tests get an
H.264 camera over RTSP (`H264_SERVERS`, `server=`).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile

START_TIMEOUT_S = 15.0

MISSING_REASON = (
    "no RTSP peer: needs GStreamer's RTSP server for the system Python (Debian: apt-get "
    "install -y --no-install-recommends python3-gi gir1.2-gst-rtsp-server-1.0 "
    "gstreamer1.0-plugins-base gstreamer1.0-plugins-good)"
)

# argv: port width height fps encoding. A moving ball over RTP, shared by every client: MJPEG, or
# H.264 (x264enc where GStreamer has it, else openh264enc; a keyframe a second, its SPS/PPS in the
# SDP and before each keyframe).
_SERVER = r'''
import sys
import gi
gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer

port, width, height, fps, encoding = sys.argv[1:6]
Gst.init(None)
if encoding == "jpeg":
    encode = "jpegenc ! rtpjpegpay name=pay0 pt=26"
elif Gst.ElementFactory.find("x264enc"):
    encode = (f"x264enc tune=zerolatency speed-preset=superfast key-int-max={fps} bframes=0 "
              "! h264parse ! rtph264pay name=pay0 pt=96 config-interval=1")
elif Gst.ElementFactory.find("openh264enc"):
    encode = f"openh264enc gop-size={fps} ! h264parse ! rtph264pay name=pay0 pt=96 config-interval=1"
else:
    sys.exit("no H.264 encoder in GStreamer (x264enc or openh264enc)")
server = GstRtspServer.RTSPServer()
server.set_address("127.0.0.1")
server.set_service(port)
factory = GstRtspServer.RTSPMediaFactory()
factory.set_launch(
    "( videotestsrc is-live=true pattern=ball "
    f"! video/x-raw,format=I420,width={width},height={height},framerate={fps}/1 ! {encode} )"
)
factory.set_shared(True)
server.get_mount_points().add_factory("/cam", factory)
if server.attach(None) == 0:
    sys.exit("cannot listen on port " + port)
print("ready", flush=True)
GLib.MainLoop().run()
'''


# argv: port width height fps. The same scene as GStreamer's: a white ball moving on black, a
# loop of two seconds; the `rtsp` package encodes it (baseline H.264, a keyframe a second, its
# SPS/PPS in the SDP) and serves it on every interface.
_PYTHON_H264_SERVER = r'''
import sys
import cv2
import numpy as np
import rtsp

port, width, height, fps = (int(value) for value in sys.argv[1:5])
frames = []
for index in range(2 * fps):
    frame = np.zeros((height, width, 3), np.uint8)
    cv2.circle(frame, (20 + (width - 40) * index // (2 * fps - 1), height // 2), height // 12, (255, 255, 255), -1)
    frames.append(frame)
with rtsp.Source(f"rtsp://127.0.0.1:{port}/cam", fps=fps, size=(width, height), frame_buffer=frames) as source:
    if not source.wait_ready(10):
        sys.exit(f"cannot listen on port {port}")
    print("ready", flush=True)
    source.serve_forever()
'''

# An H.264 peer's servers: GStreamer's (a Python with it: `gst_python()`) and the `rtsp` package's
# (this interpreter, where the package is installed: `python_h264_server()`).
H264_SERVERS = ("gstreamer", "rtsp-package")
PYTHON_H264_MISSING_REASON = "no RTSP peer: the `rtsp` package (the `test` extra) is not installed"


def python_h264_server() -> str | None:
    """This interpreter, where it has the `rtsp` package (and PyAV, OpenCV) for an H.264 peer."""
    probe = subprocess.run([sys.executable, "-c", "import rtsp, av, cv2"], capture_output=True, timeout=60,
                           check=False)
    return sys.executable if probe.returncode == 0 else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """SIGKILL (when still running) and reap."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def gst_python() -> str | None:
    """A Python that has PyGObject and GstRtspServer, or None."""
    for candidate in (os.environ.get("FACECAST_TEST_GST_PYTHON"), "/usr/bin/python3"):
        if not candidate or not os.path.exists(candidate):
            continue
        probe = subprocess.run(
            [candidate, "-c", "import gi; gi.require_version('GstRtspServer', '1.0'); "
             "from gi.repository import GstRtspServer"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        if probe.returncode == 0:
            return candidate
    return None


class RtspPeer:
    """`rtsp://127.0.0.1:<port>/cam`; `start()` returns once it listens, `kill()` is a crash."""

    def __init__(self, python: str, port: int | None = None, *, width: int = 320,
                 height: int = 240, fps: int = 25, encoding: str = "jpeg", server: str = "gstreamer") -> None:
        if encoding not in ("jpeg", "h264"):
            raise ValueError(f"an RTSP peer sends jpeg or h264, not {encoding!r}")
        if server not in H264_SERVERS or (server != "gstreamer" and encoding != "h264"):
            raise ValueError(f"an RTSP peer's server is one of {H264_SERVERS} (not GStreamer's: h264 only), "
                             f"not {server!r} for {encoding}")
        self.python = python
        self.encoding = encoding
        self.server = server
        self.port = port or free_port()
        self.width, self.height, self.fps = width, height, fps
        self.process: subprocess.Popen[bytes] | None = None
        self._stderr = None

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self) -> None:
        self._stderr = tempfile.TemporaryFile()
        arguments = ([_SERVER, str(self.port), str(self.width), str(self.height), str(self.fps), self.encoding]
                     if self.server == "gstreamer" else
                     [_PYTHON_H264_SERVER, str(self.port), str(self.width), str(self.height), str(self.fps)])
        self.process = subprocess.Popen(
            [self.python, "-c", *arguments],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], START_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else b"(nothing)"
        if line.strip() != b"ready":  # "ready" once listening
            self._stderr.seek(0)
            stderr = self._stderr.read().decode(errors="replace")
            self.kill()
            raise AssertionError(f"RTSP peer did not start: {line!r} {stderr}")

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            stop(self.process)
            self.process.stdout.close()
            self.process = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
