"""The web console (workers/console*.py, README "Web console"): a real daemon on the CPU with the
console on a free port, real HTTP requests; the token rules also against the real aiohttp app
served in-process (a non-loopback bind is decided by the config, served here on loopback).

Note [Console security] in facecast.workers.console_http is what the token tests guard.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pytest

from daemon_harness import box_close, ready_daemon
from facecast.shared import config as config_mod
from facecast.workers.console import read_console_file
from facecast.workers.sources import synthetic_truth

TOKEN = "console-test-token-0123456789"
CONFIG = f"""
[daemon]
transport = "shm"

[output]
max_faces = 2

[web]
enabled = true
allow_control = true
token = "{TOKEN}"
preview_width = 320

[[cameras]]
id = "web0"
source = "synthetic"
width = 640
height = 360
fps = 15
"""
CAMERA = config_mod.loads(CONFIG).camera("web0")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("console"), config_text=CONFIG) as running:
        running.url = _console_url(running)
        yield running


def _console_url(daemon, not_pid: int = 0, timeout_s: float = 60.0) -> str:
    """The console's URL once it listens (it starts at READY: Note [Console after READY])."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        console = read_console_file(daemon.runtime_dir)
        if console is not None and console["pid"] != not_pid:
            return console["url"]
        time.sleep(0.1)
    raise AssertionError(f"no web console within {timeout_s} s\n{daemon.log_tail()}")


def _get(url: str, headers: dict | None = None, method: str = "GET", body: bytes | None = None,
         timeout_s: float = 20.0) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _post(url: str, token: str | None, payload: dict | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, _, body = _get(url, headers, "POST", json.dumps(payload or {}).encode())
    return status, body


def _paired_preview(url: str, size: str, timeout_s: float = 60.0):
    """A preview whose faces were measured on its own frame (Note [Preview pairing])."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, headers, body = _get(f"{url}api/cameras/web0/preview.jpg?size={size}")
        if status == 200 and headers["X-Paired"] == "1" and json.loads(headers["X-Faces"]):
            return headers, body
        time.sleep(0.1)
    raise AssertionError(f"no paired preview with faces within {timeout_s} s")


def test_status_command_shows_the_console(daemon):
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "facecast.daemon.cli", "status", "--runtime-dir",
         str(daemon.runtime_dir)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"web console: {daemon.url} (control with the token)" in shown.stdout, shown.stdout


def test_pages_and_static_files_load(daemon):
    status, headers, body = _get(daemon.url)
    assert status == 200 and b"/static/console.js" in body, body[:200]
    for path, kind in (("static/console.js", "javascript"), ("static/console.css", "css"),
                       ("camera/web0", "html")):
        status, headers, body = _get(daemon.url + path)
        assert status == 200 and kind in headers["Content-Type"], (path, status, body)
        assert body, path


def test_preview_shows_the_camera_with_a_box_on_each_true_face(daemon):
    headers, body = _paired_preview(daemon.url, "large")
    image = cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR)
    assert image.shape == (360, 640, 3)  # "large": twice web.preview_width, the camera's aspect
    capture_ts_lsl = float(headers["X-Capture-Ts-Lsl"])
    scene = synthetic_truth(CAMERA)
    # The camera's frame of that capture time (a pure function of it), not another one.
    rendered = scene.render(capture_ts_lsl).astype(np.float32)
    earlier = scene.render(capture_ts_lsl - 0.5).astype(np.float32)
    error = np.abs(image.astype(np.float32) - rendered).mean()
    error_earlier = np.abs(image.astype(np.float32) - earlier).mean()
    assert error < 8 and error < error_earlier / 2, (error, error_earlier)
    faces = json.loads(headers["X-Faces"])
    truth = scene.faces_at(capture_ts_lsl)
    assert len(faces) == len(truth) == 2, (faces, truth)
    boxes = [face["box_px"] for face in faces]
    for face in truth:
        assert box_close(face.box_px, boxes, tolerance=0.15), (face, boxes)
    # ...and each box is drawn into the image: its top edge is green.
    for x1, y1, x2, _ in boxes:
        row = image[int(round(y1)), int(x1) + 6:int(x2) - 6].astype(int)
        green = (row[:, 1] > 150) & (row[:, 1] - row[:, 2] > 50)
        assert green.mean() > 0.5, (x1, y1, x2, green.mean())
    small_status, small_headers, small_body = _get(f"{daemon.url}api/cameras/web0/preview.jpg")
    small = cv2.imdecode(np.frombuffer(small_body, np.uint8), cv2.IMREAD_COLOR)
    assert small_status == 200 and small.shape == (180, 320, 3)  # web.preview_width = 320


def test_status_and_events_stream_deliver_updates_and_markers(daemon):
    status, _, body = _get(daemon.url + "api/status")
    snapshot = json.loads(body)
    assert status == 200 and snapshot["status"]["ready"] and "web0" in snapshot["status"]["cameras"]
    names = {worker["name"] for worker in snapshot["status"]["workers"]}
    assert {"console", "output", "capture:web0"} <= names
    # A marker comes back on the console's log only once its inlet is connected (Note [Markers
    # through LSL]); the console says so in its status.
    deadline = time.monotonic() + 60
    while not snapshot["console"]["markers"].startswith("reading "):
        assert time.monotonic() < deadline, (snapshot["console"], daemon.log_tail())
        time.sleep(0.1)
        snapshot = json.loads(_get(daemon.url + "api/status")[2])
    text = f"marker from the test {time.monotonic()}"
    statuses, marker = [], None
    with urllib.request.urlopen(daemon.url + "api/events", timeout=30) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        assert _post(daemon.url + "api/control/marker", TOKEN, {"text": text})[0] == 200
        deadline = time.monotonic() + 60
        kind = None
        while (marker is None or len(statuses) < 2) and time.monotonic() < deadline:
            line = stream.readline().decode().strip()
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                if kind == "status":
                    statuses.append(data["status"]["uptime_s"])
                    assert "camera:web0" in data["history_point"]
                elif kind == "marker" and data["event"].get("text") == text:
                    marker = data
    assert len(statuses) >= 2 and statuses[-1] > statuses[0], statuses
    # The marker went round: console → supervisor → output's Markers outlet → the console's inlet.
    assert marker is not None and marker["event"]["event"] == "console_marker", daemon.log_tail()
    assert marker["ts_lsl"] > 0
    history = json.loads(_get(daemon.url + "api/status")[2])["history"]["camera:web0"]
    assert len(history) >= 2


@pytest.mark.parametrize("path, method, expected", [
    ("api/cameras/nope/preview.jpg", "GET", 404),
    ("camera/nope", "GET", 404),
    ("no/such/page", "GET", 404),
    ("static/../../etc/passwd", "GET", 404),
    ("api/cameras/web0/preview.jpg?size=huge", "GET", 400),
    ("api/cameras/web0/preview.jpg?mesh=2", "GET", 400),
    ("api/cameras/web0/preview.jpg?width=10", "GET", 400),
    ("api/control/dance", "POST", 404),
    ("api/control/reload", "GET", 405),
    ("api/status", "DELETE", 405),
])
def test_bad_requests_get_4xx_with_a_short_reason(daemon, path, method, expected):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    status, _, body = _get(daemon.url + path, headers, method, b"" if method == "POST" else None)
    assert status == expected, (path, status, body)
    assert b"Traceback" not in body and len(body) < 400 and body.strip(), body


def test_bad_marker_bodies_get_400(daemon):
    url = daemon.url + "api/control/marker"
    for payload in (b"not json", b'{"text": ""}', b'{"text": 5}', json.dumps({"text": "x" * 201}).encode()):
        status, _, body = _get(url, {"Authorization": f"Bearer {TOKEN}"}, "POST", payload)
        assert status == 400 and b"Traceback" not in body, (payload, status, body)


def test_control_needs_the_token(daemon):
    url = daemon.url + "api/control/reload"
    assert _post(url, None)[0] == 401
    assert _post(url, "wrong-token-0123456789")[0] == 401
    status, body = _post(url, TOKEN)
    assert status == 200 and json.loads(body)["ok"], body
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        events = json.loads(_get(daemon.url + "api/status")[2])["events"]
        if any(entry["event"]["event"] == "reload" for entry in events):
            return
        time.sleep(0.2)
    raise AssertionError(f"no reload marker on the console's log\n{daemon.log_tail()}")


def test_console_killed_comes_back_while_the_face_streams_flow(daemon):
    from daemon_harness import Recorder

    records = daemon.resolve("Face", 2)
    assert [r.source_id for r in records] == [f"facecast-{daemon.host}-web0-face0",
                                              f"facecast-{daemon.host}-web0-face1"]
    recorder = Recorder(records)
    try:
        old = daemon.wait_for_worker("console", "running")
        killed_monotonic = time.monotonic()
        os.kill(old.pid, signal.SIGKILL)
        new = daemon.wait_for_worker("console", "running", not_pid=old.pid)
        daemon.url = url = _console_url(daemon, not_pid=old.pid)  # a new free port
        _paired_preview(url, "small")
        back_s = time.monotonic() - killed_monotonic
        print(f"console back and serving a paired preview {back_s:.1f} s after SIGKILL")
        assert new.restarts >= 1
        stamps = records[0].timestamps
        count_at_kill = len(stamps)
        deadline = time.monotonic() + 20
        while len(stamps) < count_at_kill + 15 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        recorder.stop()
    # The Face stream never stopped: samples throughout, no gap beyond a busy CPU's jitter.
    window = np.asarray([s for s in records[0].timestamps
                         if s >= records[0].timestamps[0] and s > 0])
    assert len(stamps) >= count_at_kill + 15, "the Face stream stopped after the console's kill"
    assert np.diff(window).max() < 2.0, np.diff(window).max()


def test_stop_from_the_console_stops_the_daemon(daemon):
    status, body = _post(daemon.url + "api/control/stop", TOKEN)
    assert status == 200 and json.loads(body)["ok"], body
    daemon.process.wait(30)
    assert daemon.process.returncode == 0, daemon.log_tail()


# ================================================================================================
# The token rules against the real app, in-process (no daemon): Note [Console security]
# ================================================================================================


def _serve(config_text: str, checks) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from facecast.workers.console_http import ConsoleState, build_app
    from facecast.workers.console_preview import OpenCvJpegEncoder

    config = config_mod.loads(config_text)

    async def control(action, body):
        return True, ""

    async def main():
        state = ConsoleState(config, [c.id for c in config.cameras], OpenCvJpegEncoder(),
                             config.web.token or "generated-token-0123456789")
        async with TestClient(TestServer(build_app(state, control), host="127.0.0.1")) as client:
            await checks(client)

    asyncio.run(main())


def test_off_loopback_every_request_needs_the_token():
    text = CONFIG.replace('allow_control = true', 'host = "0.0.0.0"')

    async def checks(client):
        for path in ("/", "/api/status", "/static/console.js", "/api/events"):
            response = await client.get(path)
            assert response.status == 401, path
            assert response.headers["WWW-Authenticate"] == "Bearer"
        response = await client.get("/api/status", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status == 200
        assert (await client.get("/api/status", headers={
            "Authorization": "Bearer not-the-token-0123456789"})).status == 401
        # A browser: ?token= once, then the HttpOnly, SameSite=Strict cookie.
        response = await client.get(f"/?token={TOKEN}")
        assert response.status == 200
        cookie = response.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
        assert (await client.get("/api/status")).status == 200  # the cookie jar has it now
        response = await client.post("/api/control/reload",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status == 403  # allow_control is off: read-only even with the token

    _serve(text, checks)


def test_loopback_read_only_console_refuses_control_and_foreign_hosts():
    text = CONFIG.replace('allow_control = true', 'allow_control = false')

    async def checks(client):
        assert (await client.get("/api/status")).status == 200  # no token needed to read here
        for action in ("reload", "stop", "marker"):
            response = await client.post(f"/api/control/{action}",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status == 403 and "read-only" in await response.text()
        # DNS rebinding: a page of another site that resolves its name to 127.0.0.1.
        response = await client.get("/api/status", headers={"Host": "evil.example:8420"})
        assert response.status == 403 and "loopback" in await response.text()

    _serve(text, checks)


@pytest.mark.parametrize("table, expected", [
    ('host = "example.org"', "web.host"),
    ('host = "300.1.2.3"', "web.host: '300.1.2.3' is not an IP address"),
    ("port = 70000", "web.port"),
    ("preview_fps = 30", "web.preview_fps"),
    ("preview_fps = 2", "web.preview_fps"),
    ('token = "short"', "web.token"),
    ("preview_width = 10", "web.preview_width"),
    ("colour = 1", "web.colour: unknown key"),
])
def test_bad_web_config_names_the_key(table, expected):
    with pytest.raises(config_mod.ConfigError) as error:
        config_mod.loads(f"[web]\n{table}\n[[cameras]]\nid = \"a\"\nsource = \"synthetic\"\n")
    assert expected in str(error.value), str(error.value)


def test_default_config_turns_the_console_on_at_loopback():
    web = config_mod.load(Path(__file__).resolve().parents[1] / "config/default.toml").web
    assert web.enabled and web.host == "127.0.0.1" and not web.allow_control
