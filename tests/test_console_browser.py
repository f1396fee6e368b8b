"""The web console in a real browser, and its Prometheus metrics (issue 16's tests).

One daemon for the module (two synthetic cameras with faces, `brw0` and `brw1`), read by
headless Chromium from Debian's packages (`chromium`, `chromium-driver`: .ci/run installs them)
driven by Selenium with the system chromedriver: never Selenium Manager, which would download a
browser and there is no internet. Without them the browser tests skip, saying so; the metrics
tests need no browser.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_harness import box_close, ready_daemon
from facecast.shared import config as config_mod
from facecast.workers.console.worker import read_console_file
from facecast.workers.capture.sources import synthetic_truth

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CAMERA_IDS = ("brw0", "brw1")
PREVIEW_WIDTH = 480  # the grid's previews: 480 x 270 of the cameras' 640 x 360
TOKEN = "browser-test-token-0123456789"  # every request needs it (Note [Console security])
CONFIG = f"""
[daemon]
transport = "shm"
warm_standby = "off"  # Note [Spares only where a test needs them]

[output]
max_faces = 2

[web]
enabled = true
preview_width = 480
token = "{TOKEN}"

[[cameras]]
id = "brw0"
source = "synthetic"
width = 640
height = 360
fps = 10

[[cameras]]
id = "brw1"
source = "synthetic"
width = 640
height = 360
fps = 10
"""
PARSED = config_mod.loads(CONFIG)
SCREENSHOT_SIZE = (1280, 800)
RESTART_SHOWN_WITHIN_S = 5.0  # issue 16: a SIGKILLed worker shows as restarted on the page
TRUTH_TOLERANCE = 0.15  # of the true face's size, as tests/test_console.py's preview check


def _browser_missing() -> str:
    missing = [f"{path} (Debian package {package})"
               for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver"))
               if not path.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    return ", ".join(missing)


needs_browser = pytest.mark.skipif(bool(_browser_missing()),
                                   reason=f"no headless browser: missing {_browser_missing()}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("console-browser"), config_text=CONFIG) as running:
        running.url = _console_url(running)
        yield running


def _console_url(daemon, timeout_s: float = 60.0) -> str:
    """The console's URL once it listens (web-console.json; it starts at READY)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        console = read_console_file(daemon.runtime_dir)
        if console is not None:
            return console["url"]
        time.sleep(0.1)
    raise AssertionError(f"no web console within {timeout_s} s\n{daemon.log_tail()}")


def _new_driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)  # with the driver's path: no Selenium Manager
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800",
                     "--disable-extensions", "--no-first-run"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(20)
    # The page's own size (a window's is less its frame): README's screenshot is one of these.
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": SCREENSHOT_SIZE[0], "height": SCREENSHOT_SIZE[1], "deviceScaleFactor": 1,
        "mobile": False})
    return driver


@pytest.fixture(scope="module")
def browser(daemon):
    driver = _new_driver()
    try:
        driver.get(f"{daemon.url}?token={TOKEN}")  # the printed link: sets the cookie
        yield driver
    finally:
        driver.quit()


def _wait(what: str, check, timeout_s: float, interval_s: float = 0.1):
    """check() until it returns something true (returned) or the deadline; `what` for the error,
    with the last value check() saw when it returns a (False, detail) pair."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        value = check()
        if isinstance(value, tuple) and len(value) == 2 and value[0] is False:
            last = value[1]
        elif value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s; last: {last}")
        time.sleep(interval_s)


_READ_PREVIEW = """
const img = document.querySelector(`img[data-camera="${arguments[0]}"]`);
if (!img || !img.dataset.frameSeq || !img.complete || !img.naturalWidth) return null;
const canvas = document.createElement("canvas");
canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
canvas.getContext("2d").drawImage(img, 0, 0);
return {frame_seq: Number(img.dataset.frameSeq), capture_ts_lsl: Number(img.dataset.captureTsLsl),
        paired: img.dataset.paired === "1", faces: JSON.parse(img.dataset.faces || "[]"),
        png: canvas.toDataURL("image/png")};
"""


def _preview_on_page(driver, camera_id: str) -> dict | None:
    """The preview the page shows now, its pixels read back from the <img> (BGR) and the frame
    it says it is (data-* attributes set from the preview's headers with its src: once the
    <img> is complete, they name the frame its pixels are)."""
    shown = driver.execute_script(_READ_PREVIEW, camera_id)
    if shown is None:
        return None
    png = base64.b64decode(shown.pop("png").split(",", 1)[1])
    shown["image"] = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)
    return shown


_READ_HEALTH = """
const cells = row => [...row.cells].map(cell => cell.textContent);
const cameras = {};
for (const box of document.querySelectorAll("[id^=numbers-]")) {
  const spans = [...box.children].filter(node => !node.classList.contains("why"));
  const pairs = {};
  for (let i = 0; i + 1 < spans.length; i += 2) pairs[spans[i].textContent] = spans[i + 1].textContent;
  cameras[box.id.slice("numbers-".length)] = pairs;
}
return {daemon: document.getElementById("daemon-line").textContent,
        workers: [...document.querySelectorAll("#workers tr")].slice(1).map(cells),
        cameras: cameras};
"""


def _health_on_page(driver) -> dict:
    health = driver.execute_script(_READ_HEALTH)
    health["workers"] = {row[0]: {"state": row[1], "restarts": int(row[2])}
                         for row in health["workers"]}
    return health


def _severe_browser_log(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


# ================================================================================================
# In the browser
# ================================================================================================


@pytest.mark.daemon
@needs_browser
def test_page_loads_without_errors_and_every_camera_preview_is_live(daemon, browser):
    firsts = {}
    for camera_id in CAMERA_IDS:
        firsts[camera_id] = _wait(f"a preview of {camera_id} on the page",
                                  lambda: _preview_on_page(browser, camera_id), 60)
    cards = browser.execute_script(
        "return [...document.querySelectorAll('#cameras img')].map(img => img.dataset.camera)")
    assert sorted(cards) == sorted(CAMERA_IDS), cards  # one live preview per configured camera
    for camera_id, first in firsts.items():
        assert first["image"].shape == (270, PREVIEW_WIDTH, 3), first["image"].shape

        def changed(camera_id=camera_id, first=first):
            now = _preview_on_page(browser, camera_id)
            if now is None:  # between two previews: the page is loading the next one
                return False, "no preview shown at that moment"
            if now["frame_seq"] > first["frame_seq"]:
                return now
            return False, now["frame_seq"]

        later = _wait(f"a newer preview of {camera_id}", changed, 20)
        # The picture itself moved (the synthetic faces drift), not only its number.
        difference = np.abs(later["image"].astype(np.int16) - first["image"]).mean()
        assert later["capture_ts_lsl"] > first["capture_ts_lsl"]
        assert difference > 0.5, (camera_id, difference, first["frame_seq"], later["frame_seq"],
                                  first["capture_ts_lsl"], later["capture_ts_lsl"])
    assert _severe_browser_log(browser) == []


@pytest.mark.daemon
@needs_browser
def test_overlay_box_lies_on_the_synthetic_faces(daemon, browser):
    for camera_id in CAMERA_IDS:
        def paired(camera_id=camera_id):
            shown = _preview_on_page(browser, camera_id)
            if shown is not None and shown["paired"] and len(shown["faces"]) == 2:
                return shown
            return False, shown and {k: v for k, v in shown.items() if k != "image"}

        shown = _wait(f"a preview of {camera_id} with its 2 faces drawn", paired, 60)
        image = shown["image"]
        scale = image.shape[1] / PARSED.camera(camera_id).width
        truth = synthetic_truth(PARSED.camera(camera_id)).faces_at(shown["capture_ts_lsl"])
        assert len(truth) == 2, truth
        # The box as drawn into the pixels: workers/console/preview.py draws it green
        # (BGR 80, 220, 80); JPEG blurs it, so the test takes clearly green pixels.
        blue, green, red = (image[..., i].astype(np.int16) for i in range(3))
        is_green = (green > 150) & (green - red > 50) & (green - blue > 50)
        for face in truth:
            box = [value * scale for value in face.box_px]
            drawn = _drawn_box_near(is_green, box)
            assert drawn is not None and box_close(box, [drawn], TRUTH_TOLERANCE), (
                camera_id, face.name, box, drawn, shown["faces"])


def _drawn_box_near(is_green: np.ndarray, box: list[float]) -> list[float] | None:
    """The rectangle drawn around `box` (x1, y1, x2, y2): the outermost rows and columns, within
    a margin of the box, that are green along at least half the box's size."""
    x1, y1, x2, y2 = box
    margin = 0.3 * (x2 - x1)
    height, width = is_green.shape
    left, top = max(0, int(x1 - margin)), max(0, int(y1 - margin))
    right, bottom = min(width, int(x2 + margin) + 1), min(height, int(y2 + margin) + 1)
    region = is_green[top:bottom, left:right]
    needed = 0.5 * (x2 - x1)
    rows = np.flatnonzero(region.sum(axis=1) >= needed)
    columns = np.flatnonzero(region.sum(axis=0) >= needed)
    if len(rows) < 2 or len(columns) < 2:
        return None
    return [left + columns[0], top + rows[0], left + columns[-1], top + rows[-1]]


@pytest.mark.daemon
@needs_browser
def test_health_numbers_on_the_page_match_facecast_status(daemon, browser):
    def matches():
        page = _health_on_page(browser)
        status = daemon.status()
        problems = []
        if f"pid {status.pid}," not in page["daemon"]:
            problems.append(("daemon line", page["daemon"], status.pid))
        expected = {w.name + (" (spare)" if w.standby else ""): w for w in status.workers}
        if set(page["workers"]) != set(expected):
            problems.append(("workers", sorted(page["workers"]), sorted(expected)))
        for name, worker in expected.items():
            shown = page["workers"].get(name)
            if shown is not None and (shown["state"], shown["restarts"]) != (worker.state,
                                                                            worker.restarts):
                problems.append((name, shown, worker.state, worker.restarts))
        for camera_id in CAMERA_IDS:
            shown = page["cameras"].get(camera_id, {})
            reports = status.cameras[camera_id]
            capture = next(r for r in reports if r.source)
            output = next((r for r in reports if r.latency_ms is not None), None)
            if (shown.get("transport"), shown.get("source")) != (capture.transport,
                                                                 capture.source):
                problems.append((camera_id, shown, capture))
            captured_fps = float(shown.get("captured", "nan").split()[0])
            # The page shows the status of up to a second ago; rates move a little in that time.
            if not abs(captured_fps - capture.fps) <= 1.5:
                problems.append((camera_id, "captured", captured_fps, capture.fps))
            if output is None or str(output.faces) != shown.get("faces"):
                problems.append((camera_id, "faces", shown.get("faces"),
                                 output and output.faces))
        return (False, problems) if problems else True

    _wait("the page's health numbers equal to `facecast status`", matches, 20, interval_s=0.3)


@pytest.mark.daemon
@needs_browser
def test_screenshot_of_the_console(daemon, browser, tmp_path_factory):
    """A screenshot as the test's artifact, in the steady state (README's docs/console.png is
    one of these)."""
    for camera_id in CAMERA_IDS:
        _wait(f"{camera_id}'s faces on the page",
              lambda camera_id=camera_id: (lambda shown: shown and shown["paired"]
                                           and shown["faces"])(
                  _preview_on_page(browser, camera_id)), 60)
    path = tmp_path_factory.mktemp("artifacts") / "console.png"
    assert browser.save_screenshot(str(path))
    image = cv2.imread(str(path))
    assert image is not None and image.shape[:2] == SCREENSHOT_SIZE[::-1], (
        None if image is None else image.shape)
    print(f"console screenshot: {path}")
    assert _severe_browser_log(browser) == []


@pytest.mark.daemon
@needs_browser
def test_a_killed_worker_shows_as_restarted_within_5_s(daemon, browser):
    victim = daemon.wait_for_worker("capture:brw1", "running")
    shown_before = _health_on_page(browser)["workers"]["capture:brw1"]
    assert shown_before["restarts"] == victim.restarts, (shown_before, victim)
    killed_monotonic = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)

    def restarted():
        shown = _health_on_page(browser)["workers"].get("capture:brw1")
        if shown and shown["restarts"] == victim.restarts + 1 and shown["state"] == "running":
            return True
        return False, shown

    _wait("capture:brw1 restarted on the page", restarted, 30, interval_s=0.05)
    shown_after_s = time.monotonic() - killed_monotonic
    print(f"capture:brw1 shown restarted on the page {shown_after_s:.2f} s after SIGKILL")
    assert shown_after_s < RESTART_SHOWN_WITHIN_S, shown_after_s
    assert daemon.worker("capture:brw1").pid != victim.pid
    assert _severe_browser_log(browser) == []  # the page rode through the restart


# ================================================================================================
# /metrics (no browser)
# ================================================================================================


def _get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _samples(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text → {sample name: {sorted label items: value}}, by prometheus-client's own
    parser (which also rejects a malformed exposition)."""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("facecast_"), family.name
        assert family.documentation, family.name
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


@pytest.mark.daemon
def test_metrics_match_the_daemon_status(daemon):
    def matches():
        status_code, headers, body = _get(daemon.url + "metrics",
                                          {"Authorization": f"Bearer {TOKEN}"})
        assert status_code == 200, body
        assert headers["Content-Type"].startswith("text/plain; version="), headers
        metrics = _samples(body.decode())
        status = daemon.status()
        problems = []
        assert metrics["facecast_ready"][()] == 1.0
        for worker in status.workers:
            labels = (("role", worker.role), ("spare", str(worker.standby).lower()),
                      ("worker", worker.name))
            if metrics["facecast_worker_restarts_total"].get(labels) != worker.restarts:
                problems.append((worker.name, "restarts"))
            state_labels = tuple(sorted(labels + (("state", worker.state),)))
            if metrics["facecast_worker_state"].get(state_labels) != 1.0:
                problems.append((worker.name, "state", worker.state))
        restart_series = metrics["facecast_worker_restarts_total"]
        if len(restart_series) != len(status.workers):
            problems.append(("workers", sorted(restart_series), len(status.workers)))
        for camera_id in CAMERA_IDS:
            camera = (("camera", camera_id),)
            reports = status.cameras[camera_id]
            capture = next(r for r in reports if r.source)
            output = next(r for r in reports if r.latency_ms is not None)
            # The metrics show the console's status of up to a second ago.
            captured = metrics["facecast_camera_captured_frames_total"][camera]
            if not capture.frames - 2 * capture.fps - 2 <= captured <= capture.frames:
                problems.append((camera_id, "captured frames", captured, capture.frames))
            fps = metrics["facecast_camera_captured_frames_per_second"][camera]
            if not abs(fps - capture.fps) <= 1.5:
                problems.append((camera_id, "fps", fps, capture.fps))
            if metrics["facecast_camera_faces"][camera] != output.faces:
                problems.append((camera_id, "faces"))
            fallback = metrics["facecast_camera_transport_fallback"]
            if fallback.get(camera + (("reason", capture.fallback_reason),
                                      ("transport", capture.transport))) != 0.0:
                problems.append((camera_id, "transport", fallback, capture.transport))
            latency = metrics["facecast_camera_capture_to_lsl_seconds"]
            p50 = latency[camera + (("quantile", "0.5"),)]
            p99 = latency[camera + (("quantile", "0.99"),)]
            assert 0 < p50 <= p99 < 10, (p50, p99)  # seconds, not milliseconds
            count = metrics["facecast_camera_capture_to_lsl_samples_total"][camera]
            assert 0 < count <= output.latency_ms.count, (count, output.latency_ms)
        stages = metrics["facecast_stage_runs_total"]
        if {dict(labels)["stage"] for labels in stages} - set(status.stages):
            problems.append(("stages", sorted(stages), sorted(status.stages)))
        assert 0 <= metrics["facecast_status_age_seconds"][()] < 5
        return (False, problems) if problems else True

    _wait("/metrics equal to `facecast status`", matches, 20, interval_s=0.3)


def test_metrics_follow_the_console_security_rules():
    """In-process, against the real app: off loopback /metrics needs the token like every
    other read (Note [Console security]); before the first status it answers 503; on loopback
    it needs the token too, whatever the port in the Host header, and refuses other host
    names."""
    from aiohttp.test_utils import TestClient, TestServer

    from facecast.workers.console.http import ConsoleState, build_app
    from facecast.workers.console.preview import OpenCvJpegEncoder

    token = TOKEN
    config = config_mod.loads(CONFIG.replace("[web]\n", '[web]\nhost = "0.0.0.0"\n'))
    status = {"ready": True, "uptime_s": 3.0, "workers": [], "cameras": {"brw0": []},
              "stages": {}, "gpus": [{"index": 0, "name": "GPU", "memory_used_mib": 512.0,
                                      "memory_total_mib": 1024.0, "utilization_pct": 25.0}]}

    async def main():
        state = ConsoleState(config, list(CAMERA_IDS), OpenCvJpegEncoder(), token)
        async with TestClient(TestServer(build_app(state, None), host="127.0.0.1")) as client:
            response = await client.get("/metrics")
            assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
            authorised = {"Authorization": f"Bearer {token}"}
            response = await client.get("/metrics", headers=authorised)
            assert response.status == 503 and "no status" in await response.text()
            state.set_status(status, time.time())
            response = await client.get("/metrics", headers=authorised)
            assert response.status == 200
            return _samples(await response.text())

    metrics = asyncio.run(main())

    async def on_loopback():
        # README's SSH port forward: the browser's Host is 127.0.0.1 with whichever local port.
        loopback = config_mod.loads(CONFIG)
        state = ConsoleState(loopback, list(CAMERA_IDS), OpenCvJpegEncoder(), token)
        state.set_status(status, time.time())
        async with TestClient(TestServer(build_app(state, None), host="127.0.0.1")) as client:
            assert (await client.get("/metrics")).status == 401
            for host, expected in (("127.0.0.1:9000", 200), ("localhost:8420", 200),
                                   ("labmachine.example:8420", 403)):
                response = await client.get("/metrics", headers={
                    "Host": host, "Authorization": f"Bearer {token}"})
                assert response.status == expected, (host, response.status)

    asyncio.run(on_loopback())
    gpu = (("gpu", "0"), ("name", "GPU"))
    assert metrics["facecast_gpu_memory_used_bytes"][gpu] == 512 * 1024 * 1024
    assert metrics["facecast_gpu_memory_total_bytes"][gpu] == 1024 * 1024 * 1024
    assert metrics["facecast_gpu_utilization_ratio"][gpu] == 0.25


# ================================================================================================
# Cross-site requests from a real browser (issue 21; no daemon: the real app, served here)
# ================================================================================================


def _serve_in_thread(app) -> tuple[str, callable]:
    """`app` on a free loopback port, on an event loop of its own thread: (its URL, stop)."""
    import threading

    from aiohttp import web

    loop = asyncio.new_event_loop()
    started = threading.Event()
    served: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        # As the console worker serves it: handlers still in flight (the page's event stream)
        # get half a second at cleanup, not aiohttp's default 60 s.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        served["port"] = runner.addresses[0][1]
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(20), "the test's web server did not start"

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        assert not thread.is_alive(), "the test's web server did not stop"

    return f"http://127.0.0.1:{served['port']}", stop


@needs_browser
def test_a_page_of_another_origin_cannot_make_the_browser_change_anything():
    """Another local user's page on another port of this machine is the same site, so the
    browser sends it the console's SameSite cookie: its form and its fetches, with the cookie,
    must change nothing, while the console's own page still sends markers (Note [Console
    security])."""
    from aiohttp import web

    from facecast.workers.console.http import ConsoleState, build_app
    from facecast.workers.console.preview import OpenCvJpegEncoder

    config = config_mod.loads(CONFIG.replace("[web]\n", "[web]\nallow_control = true\n"))
    calls: list[tuple[str, dict]] = []

    async def control(action: str, body: dict) -> tuple[bool, str]:
        calls.append((action, body))
        return True, ""

    state = ConsoleState(config, list(CAMERA_IDS), OpenCvJpegEncoder(), TOKEN)
    console_url, stop_console = _serve_in_thread(build_app(state, control))
    forged = (f'<form id="f" method="POST" enctype="text/plain" action="{console_url}'
              '/api/control/marker"><input name=\'{"text": "forged by a form", "x": "\' '
              'value=\'"}\'></form>')

    async def attacker_page(request):
        return web.Response(text=f"<!doctype html><html><body>{forged}</body></html>",
                            content_type="text/html")

    attacker = web.Application()
    attacker.router.add_get("/", attacker_page)
    attacker_url, stop_attacker = _serve_in_thread(attacker)
    driver = _new_driver()
    try:
        driver.get(f"{console_url}/?token={TOKEN}")  # the user opened the console: the cookie
        assert driver.current_url == f"{console_url}/"  # the token left the address bar
        # The console's own page: its post() (console.js), JSON from its own origin.
        driver.execute_script('post("marker", {text: "from the console page"});')
        _wait("the console page's marker", lambda: calls, 10)
        assert calls == [("marker", {"text": "from the console page"})], calls
        calls.clear()
        driver.get(attacker_url)
        statuses = driver.execute_async_script("""
            const done = arguments[arguments.length - 1];
            const target = arguments[0];
            const tries = [
              ["marker", {"Content-Type": "text/plain"}, "no-cors"],
              ["reload", {"Content-Type": "text/plain"}, "no-cors"],
              ["stop", {}, "no-cors"],
              ["marker", {"Content-Type": "application/json"}, "cors"],
            ];
            Promise.all(tries.map(([action, headers, mode]) =>
              fetch(`${target}/api/control/${action}`, {method: "POST", mode, headers,
                    credentials: "include", body: JSON.stringify({text: "forged by fetch"})})
                .then(r => r.status, e => "blocked: " + e)))
              .then(done);
        """, console_url)
        driver.execute_script('document.getElementById("f").submit();')
        _wait("the form's answer", lambda: "refused" in driver.page_source
              or "ok" in driver.page_source, 10)
        assert "cross-site" in driver.page_source, driver.page_source[:500]
        assert calls == [], (calls, statuses)
    finally:
        driver.quit()
        stop_attacker()
        stop_console()
