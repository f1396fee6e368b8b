"""The web console (workers/console*.py, README "Web console"): a real daemon on the CPU with the
console on a free port, real HTTP requests; the token rules also against the real aiohttp app
served in-process (a non-loopback bind is decided by the config, served here on loopback).

Note [Console security] is what the token tests guard.
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
from facecast.workers.console.worker import read_console_file
from facecast.workers.capture.sources import synthetic_truth

TOKEN = "console-test-token-0123456789"
CONFIG = f"""
[daemon]
transport = "shm"
warm_standby = "off"  # Note [Spares only where a test needs them]

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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a 303 comes back as itself (the ?token= link's answer)


_OPENER = urllib.request.build_opener(_NoRedirects)


def _get(url: str, headers: dict | None = None, method: str = "GET", body: bytes | None = None,
         timeout_s: float = 20.0, token: str | None = TOKEN) -> tuple[int, dict, bytes]:
    """A request with the token as a Bearer header (every request needs it: Note [Console
    security]) unless `token` is None or `headers` authenticate otherwise."""
    headers = dict(headers or {})
    if token is not None and "Cookie" not in headers:
        headers.setdefault("Authorization", f"Bearer {token}")
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _post(url: str, token: str | None, payload: dict | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    status, _, body = _get(url, headers, "POST", json.dumps(payload or {}).encode(), token=token)
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


@pytest.mark.daemon
def test_status_command_shows_the_console(daemon):
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "facecast.daemon.cli", "status", "--runtime-dir",
         str(daemon.runtime_dir)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"web console: {daemon.url} (every request needs the token)" in shown.stdout, (
        shown.stdout)


@pytest.mark.daemon
def test_pages_and_static_files_load(daemon):
    status, headers, body = _get(daemon.url)
    assert status == 200 and b"/static/console.js" in body, body[:200]
    for path, kind in (("static/console.js", "javascript"), ("static/console.css", "css"),
                       ("camera/web0", "html")):
        status, headers, body = _get(daemon.url + path)
        assert status == 200 and kind in headers["Content-Type"], (path, status, body)
        assert body, path


@pytest.mark.daemon
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


@pytest.mark.daemon
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
    events_request = urllib.request.Request(daemon.url + "api/events",
                                            headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(events_request, timeout=30) as stream:
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


@pytest.mark.daemon
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


@pytest.mark.daemon
def test_bad_marker_bodies_get_400(daemon):
    url = daemon.url + "api/control/marker"
    for payload in (b"not json", b'{"text": ""}', b'{"text": 5}', json.dumps({"text": "x" * 201}).encode()):
        status, _, body = _get(url, {"Authorization": f"Bearer {TOKEN}"}, "POST", payload)
        assert status == 400 and b"Traceback" not in body, (payload, status, body)


@pytest.mark.daemon
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


@pytest.mark.daemon
def test_loopback_console_needs_the_token_for_every_read(daemon):
    """Issue 21: the loopback console showed live previews and enrolled names to any local user
    (README "Security" says why every request needs the token, on loopback too)."""
    for path in ("", "api/status", "api/cameras/web0/preview.jpg", "metrics", "static/console.js",
                 "camera/web0"):
        status, headers, body = _get(daemon.url + path, token=None)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (path, status, body)
        assert b"token required" in body and b"Traceback" not in body
    assert _get(daemon.url + "api/status", token="not-the-token-0123456789")[0] == 401
    assert _get(daemon.url + "api/status")[0] == 200


def _browser_cookie(daemon) -> str:
    """What a browser holds after opening the printed ?token= link: the console's cookie."""
    _, headers, _ = _get(f"{daemon.url}camera/web0?token={TOKEN}&x=1", token=None)
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    return headers["Set-Cookie"].split(";", 1)[0]


@pytest.mark.daemon
def test_the_query_token_only_sets_the_cookie(daemon):
    """`?token=` answers with the cookie and a redirect without the token, and authenticates
    nothing else: not a read, not a control request."""
    status, headers, body = _get(f"{daemon.url}camera/web0?token={TOKEN}&x=1", token=None)
    assert status == 303 and headers["Location"] == "/camera/web0?x=1", (status, headers)
    assert not body.strip()  # nothing served with the token in the URL
    cookie = _browser_cookie(daemon)
    assert cookie == f"facecast_token={TOKEN}"
    status, headers, _ = _get(f"{daemon.url}api/status?token={TOKEN}", token=None)
    assert status == 303 and headers["Location"] == "/api/status"  # no data with the token
    text = f"by query token {time.monotonic()}"
    for action, payload in (("marker", {"text": text}), ("reload", {})):
        status, _, body = _get(f"{daemon.url}api/control/{action}?token={TOKEN}",
                               {"Content-Type": "application/json",
                                "Origin": daemon.url.rstrip("/")},
                               "POST", json.dumps(payload).encode(), token=None)
        assert status == 401, (action, status, body)
    assert _get(f"{daemon.url}api/status?token=wrong-token-0123456789", token=None)[0] == 401
    status, headers, _ = _get(f"{daemon.url}/evil.example/x?token={TOKEN}", token=None)
    assert status == 303 and headers["Location"] == "/evil.example/x"  # never another host
    assert _get(daemon.url + "api/status", {"Cookie": cookie}, token=None)[0] == 200


@pytest.mark.daemon
def test_cross_site_requests_that_change_something_are_refused(daemon):
    """Issue 21's CSRF: a page of another origin (another site, or another port of this host,
    which is the same site and so gets the SameSite cookie) posting a marker or a reload with
    the browser's cookie, a text/plain body and its own Origin was accepted."""
    cookie = _browser_cookie(daemon)
    own_origin = daemon.url.rstrip("/")
    port = int(own_origin.rsplit(":", 1)[1])
    other_port = f"http://127.0.0.1:{port + 1 if port < 65535 else port - 1}"
    marker = json.dumps({"text": f"forged {time.monotonic()}"}).encode()

    def post(action: str, headers: dict) -> tuple[int, bytes]:
        status, _, body = _get(f"{daemon.url}api/control/{action}", headers, "POST", marker,
                               token=None)
        return status, body

    refused = [
        {"Cookie": cookie, "Origin": "http://evil.example", "Content-Type": "text/plain"},
        {"Cookie": cookie, "Origin": other_port, "Content-Type": "text/plain"},
        {"Cookie": cookie, "Origin": other_port, "Content-Type": "application/json"},
        {"Cookie": cookie, "Origin": "null", "Content-Type": "application/json"},
        {"Cookie": cookie, "Referer": f"{other_port}/page", "Content-Type": "application/json"},
        {"Cookie": cookie, "Origin": own_origin, "Content-Type": "text/plain"},  # a form's
        {"Cookie": cookie, "Content-Type": "application/json"},  # no Origin, no Referer
        {"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.example",
         "Content-Type": "application/json"},
    ]
    for headers in refused:
        for action in ("marker", "reload", "stop"):
            status, body = post(action, headers)
            assert status == 403 and b"cross-site" in body, (action, headers, status, body)
    # The console's own page (fetch with JSON from its origin), and a script with the header.
    for headers in ({"Cookie": cookie, "Origin": own_origin, "Content-Type": "application/json"},
                    {"Cookie": cookie, "Referer": f"{own_origin}/camera/web0",
                     "Content-Type": "application/json"},
                    {"Authorization": f"Bearer {TOKEN}", "Content-Type": "text/plain"}):
        status, body = post("marker", headers)
        assert status == 200 and json.loads(body)["ok"], (headers, status, body)
    assert daemon.process.poll() is None  # no forged stop got through


def _log_lines(daemon) -> list[str]:
    return daemon.log_tail(lines=1_000_000).splitlines()


@pytest.mark.daemon
def test_oversized_headers_get_400_without_an_error_traceback_in_the_log(daemon):
    """Issue 21: each request with a header over aiohttp's limit logged a 9-line ERROR
    traceback (200 requests, 1,800 lines)."""
    import http.client

    host, port = daemon.url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
    before = len(_log_lines(daemon))
    for _ in range(20):
        connection = http.client.HTTPConnection(host, int(port), timeout=20)
        try:
            connection.request("GET", "/api/status", headers={
                "Authorization": f"Bearer {TOKEN}", "X-Big": "x" * 20_000})
            response = connection.getresponse()
            body = response.read()
        finally:
            connection.close()
        assert response.status in (400, 431), (response.status, body)
        assert b"Traceback" not in body
    assert _get(daemon.url + "api/status")[0] == 200  # and the console serves on
    # The answer goes out after the log line is written, so the log already has any.
    added = _log_lines(daemon)[before:]
    noisy = [line for line in added if "Error handling request" in line or "Traceback" in line
             or "LineTooLong" in line]
    assert not noisy, "\n".join(added[-40:])


@pytest.mark.daemon
def test_deeply_nested_or_malformed_json_markers_get_400(daemon):
    """Issue 21: JSON nested past the parser's depth gave 500 (RecursionError)."""
    url = daemon.url + "api/control/marker"
    headers = {"Content-Type": "application/json"}
    for payload in (b"[" * 30_000 + b"]" * 30_000, b'{"text": ' * 5_000 + b"1" + b"}" * 5_000,
                    b'{"text": "unterminated', b"\xff\xfe not utf-8", b"[1, 2,]"):
        status, _, body = _get(url, headers, "POST", payload)
        assert status == 400 and b"Traceback" not in body and len(body) < 400, (
            payload[:20], status, body)
    assert not any("RecursionError" in line for line in _log_lines(daemon))


@pytest.mark.daemon
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


@pytest.mark.daemon
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

    from facecast.workers.console.http import ConsoleState, build_app
    from facecast.workers.console.preview import OpenCvJpegEncoder

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
        # A browser: ?token= once, which sets the HttpOnly, SameSite=Strict cookie and sends
        # it on without the token; then the cookie.
        response = await client.get(f"/?token={TOKEN}", allow_redirects=False)
        assert response.status == 303 and response.headers["Location"] == "/"
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
        response = await client.get("/api/status")  # on loopback too (Note [Console security])
        assert response.status == 401 and "token required" in await response.text()
        assert (await client.get("/api/status", headers={
            "Authorization": f"Bearer {TOKEN}"})).status == 200
        for action in ("reload", "stop", "marker"):
            response = await client.post(f"/api/control/{action}",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status == 403 and "read-only" in await response.text()
        # DNS rebinding: a page of another site that resolves its name to 127.0.0.1.
        response = await client.get("/api/status", headers={
            "Host": "evil.example:8420", "Authorization": f"Bearer {TOKEN}"})
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
