"""The web console's HTTP side: aiohttp routes, the token and read-only rules, Server-Sent
Events, and the state they serve (facecast.workers.console.worker fills it).

Runs in the console worker only, on the event loop of its main thread.

Routes:
- `GET /`, `GET /camera/<id>`: the pages (static HTML from static/, no build step, no
  CDN); `GET /static/<file>`: their JS and CSS;
- `GET /api/status`: everything at once (JSON): the daemon's status, the sparklines' history,
  the recent Markers events, the console's own settings;
- `GET /api/events`: Server-Sent Events: `status` (about every second) and `marker` (each event
  on the Markers stream);
- `GET /api/cameras/<id>/preview.jpg?size=small|large&mesh=0|1`: the newest paired preview
  (Note [Preview pairing]);
- `GET /metrics`: Prometheus's text format (Note [Metrics from the status]); read like the other
read endpoints;
- `POST /api/control/reload`, `/stop`, `/marker` (JSON `{"text": ...}`): only with
  `web.allow_control = true` and the token.

Note [Console security]
    Safe by default. Every request needs the token, on loopback too (README "Security" says
    why: a lab machine's other accounts, and any page their browsers open, reach 127.0.0.1, and
    the previews show the lab's participants). The token is `web.token`, or one generated once,
    printed once, and kept 0600 in the runtime directory (Note [Private files]). Bound to
    loopback, a request whose Host header names another
    machine is also refused (a web page elsewhere cannot reach the console through DNS
    rebinding). Control (reload, stop, markers) is off unless `web.allow_control = true`.
    A browser presents the token once, as `?token=` in the URL that the console prints: that
    query only sets the cookie (HttpOnly, SameSite=Strict) and redirects to the same URL
    without it, so the token leaves the address bar and the history; it is never accepted as
    authentication of any other request. Scripts send `Authorization: Bearer <token>`. Tokens
    are compared in constant time.
    CSRF: SameSite is not enough, since a page on another port of the same host (another
    user's, say) is same-site and its requests carry the cookie. So a request that changes
    something (any method but GET and HEAD) is refused when its Origin (or, without one, its
    Referer) is not this console's own (`http://<Host>`), and one that authenticates with the
    cookie must also carry that Origin or Referer and a JSON body (`Content-Type:
    application/json`: a form or a "simple" fetch of another page cannot send one without a
    CORS preflight, which the console never approves). A Bearer header is itself such a
    header (no page can make a browser send it to another origin without a preflight), so a
    script that sends one needs neither.
    A bad request gets a 4xx with a one-line reason; an error of ours a 500 with no traceback
    (the log has it). Requests that aiohttp cannot parse (a header over its 8190-byte limit, a
    malformed request line) get its 400 and one debug line, not an ERROR traceback per request
    (ServerLog).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import ipaddress
import json
import logging
import time
from importlib import resources
from urllib.parse import urlsplit
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from facecast.shared.config import Config
from facecast.workers.console.preview import SIZES, CameraPreview, JpegEncoder, Overlay

log = logging.getLogger(__name__)

STATIC_DIR = Path(str(resources.files("facecast.workers.console") / "static"))
TOKEN_COOKIE = "facecast_token"
FRAME_WAIT_S = 3.0  # a preview asked for before the camera's first frame waits this long
WANTED_FOR_S = 3.0  # a camera's frames are read while a preview was asked for this recently
SSE_QUEUE_MESSAGES = 64  # an SSE client this far behind is dropped (never slows the console)
SSE_KEEPALIVE_S = 15.0
HISTORY_POINTS = 300  # sparklines: 5 minutes at one status a second
EVENTS_KEPT = 200
MARKER_TEXT_MAX = 200
LOOPBACK_NAMES = ("localhost",)
SAFE_METHODS = ("GET", "HEAD")  # what changes nothing; every other method is checked for CSRF

Control = Callable[[str, dict], Awaitable[tuple[bool, str]]]  # (action, body) -> (ok, error)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConsoleState:
    """What the HTTP side serves; written by the console worker's loop, read by handlers (one
    thread, one event loop: no locks)."""

    def __init__(self, config: Config, camera_ids: list[str], encoder: JpegEncoder,
                 token: str) -> None:
        self.config = config
        self.web = config.web
        self.token = token
        self.encoder = encoder
        self.on_loopback = is_loopback(config.web.host)  # Host names checked (the Note)
        self.previews: dict[str, CameraPreview] = {}
        self.wanted_until_monotonic: dict[str, float] = {}
        self.frame_events: dict[str, asyncio.Event] = {}
        self.status: dict | None = None  # the daemon's last DaemonStatus, as JSON builtins
        self.status_received_monotonic = 0.0
        self.history: dict[str, collections.deque] = {}
        self.events: collections.deque[dict] = collections.deque(maxlen=EVENTS_KEPT)
        self.markers_note = "looking for the Markers stream"
        self.clients: set[asyncio.Queue] = set()
        self.dropped_clients = 0
        self.set_cameras(camera_ids)

    def set_cameras(self, camera_ids: list[str]) -> None:
        self.camera_ids = list(camera_ids)
        for camera_id in list(self.previews):
            if camera_id not in camera_ids:
                del self.previews[camera_id]
        for camera_id in camera_ids:
            camera = self.config.camera(camera_id)
            preview = self.previews.get(camera_id)
            if preview is None or preview.camera_size != (camera.width, camera.height):
                self.previews[camera_id] = CameraPreview(
                    camera_id, camera.width, camera.height, self.web.preview_width,
                    self.web.preview_fps)
            self.frame_events.setdefault(camera_id, asyncio.Event())

    # -- written by the worker -------------------------------------------------------------------

    def frame_added(self, camera_id: str) -> None:
        event = self.frame_events.get(camera_id)
        if event is not None:
            event.set()
            self.frame_events[camera_id] = asyncio.Event()

    def wanted(self, camera_id: str, now_monotonic: float) -> bool:
        return now_monotonic < self.wanted_until_monotonic.get(camera_id, 0.0)

    def set_status(self, status: dict, now_s: float) -> None:
        self.status = status
        self.status_received_monotonic = time.monotonic()
        point = self._history_point(status, now_s)
        for key, value in point.items():
            self.history.setdefault(key, collections.deque(maxlen=HISTORY_POINTS)).append(value)
        self.broadcast("status", {"status": status, "history_point": point})

    def add_marker(self, text: str, timestamp_lsl: float) -> None:
        try:
            fields = json.loads(text)
        except ValueError:
            fields = {"event": "?", "text": text}
        entry = {"ts_lsl": timestamp_lsl, "text": text,
                 "event": fields if isinstance(fields, dict) else {"event": "?", "text": text}}
        self.events.append(entry)
        self.broadcast("marker", entry)

    def broadcast(self, kind: str, data: dict) -> None:
        """To every SSE client; one that is SSE_QUEUE_MESSAGES behind is dropped, so a stalled
        browser costs a bounded queue, never the console's time."""
        message = f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
        for queue in list(self.clients):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:
                self.clients.discard(queue)
                self.dropped_clients += 1  # its handler sends what it has, then ends

    @staticmethod
    def _history_point(status: dict, now_s: float) -> dict[str, list]:
        """One sparkline point per camera (t, published fps, captured fps, p99 ms, faces) and
        per GPU (t, utilisation %, memory used MiB)."""
        point = {}
        for camera_id, reports in status.get("cameras", {}).items():
            capture = next((r for r in reports if r.get("source")), None)
            output = next((r for r in reports if r.get("latency_ms") is not None), None)
            point[f"camera:{camera_id}"] = [
                round(now_s, 1), output["fps"] if output else 0.0,
                capture["fps"] if capture else 0.0,
                output["latency_ms"]["p99_ms"] if output else None,
                output["faces"] if output else 0]
        for gpu in status.get("gpus", []):
            point[f"gpu:{gpu['index']}"] = [round(now_s, 1), gpu["utilization_pct"],
                                            gpu["memory_used_mib"]]
        return point

    # -- read by handlers -------------------------------------------------------------------------

    def overlay(self, camera_id: str) -> Overlay:
        overlay = Overlay()
        for report in (self.status or {}).get("cameras", {}).get(camera_id, []):
            if report.get("source"):
                overlay.transport = report.get("transport", "")
            if report.get("latency_ms") is not None:
                overlay.fps = report.get("fps", 0.0)
        return overlay

    def snapshot(self) -> dict:
        return {
            "console": {
                "cameras": self.camera_ids,
                "preview_fps": self.web.preview_fps,
                "preview_sizes": {c: p.sizes for c, p in self.previews.items()},
                "allow_control": self.web.allow_control,
                "encoder": self.encoder.name,
                "markers": self.markers_note,
                "sse_clients": len(self.clients),
                "sse_clients_dropped": self.dropped_clients,
                "status_age_s": (round(time.monotonic() - self.status_received_monotonic, 1)
                                 if self.status is not None else None),
            },
            "status": self.status,
            "history": {key: list(points) for key, points in self.history.items()},
            "events": list(self.events),
        }


# ================================================================================================
# The application
# ================================================================================================


STATE_KEY = web.AppKey("state", ConsoleState)
CONTROL_KEY = web.AppKey("control", object)


def build_app(state: ConsoleState, control: Control | None) -> web.Application:
    app = web.Application(middlewares=[_errors, _guard], client_max_size=64 * 1024)
    app[STATE_KEY] = state
    app[CONTROL_KEY] = control
    app.router.add_get("/", _page("index.html"))
    app.router.add_get("/camera/{camera_id}", _camera_page)
    app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
    app.router.add_get("/api/status", _status)
    app.router.add_get("/api/events", _events)
    app.router.add_get("/api/cameras/{camera_id}/preview.jpg", _preview)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/api/control/{action}", _control)
    return app


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger (`logger=` of the AppRunner) with a client's request that aiohttp
    cannot parse (a header over its size limit, a malformed request line: a 4xx it answers
    itself, before any middleware) logged as one line at debug: aiohttp logs each as an ERROR
    with a 9-line traceback, so any local process could fill the journal (Note [Console
    security]). Everything else goes through as aiohttp logs it."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        if isinstance(exc_info, HttpProcessingError) and 400 <= (exc_info.code or 0) < 500:
            log.debug("console: refused a request it cannot parse (%s from %s): %s",
                      exc_info.code, args[0] if args else "?",
                      str(exc_info.message).splitlines()[0][:200] if exc_info.message else "")
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def _http_error(status: int, reason: str) -> web.Response:
    return web.Response(status=status, text=reason + "\n", content_type="text/plain")


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error as a short text: aiohttp's own 404/405, our 4xx, and a 500 without the
    traceback, which goes to the log (Note [Console security])."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = exc.text if exc.text and not exc.text.startswith(str(exc.status)) else (
            f"{exc.reason}: {request.method} {request.path}")
        response = _http_error(exc.status, reason.strip())
        for name in ("WWW-Authenticate", "Retry-After", "Allow"):
            if name in exc.headers:
                response.headers[name] = exc.headers[name]
        return response
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the client gets a line, the log gets the traceback
        log.exception("console: error serving %s %s", request.method, request.path)
        return _http_error(500, "internal error of the console (details in the daemon's log)")


def _token_matches(presented: str, token: str) -> bool:
    return hmac.compare_digest(presented.encode(), token.encode())


def _origin_problem(request: web.Request, required: bool) -> str:
    """Why this state-changing request's Origin (else Referer) is not this console's own, or
    is missing where `required` ("" when it is fine): Note [Console security]."""
    origin = request.headers.get("Origin")
    name, value = ("Origin", origin) if origin is not None else (
        "Referer", request.headers.get("Referer"))
    if value is None:
        return ("no Origin or Referer header: a browser's request that changes something must "
                "come from the console's own page") if required else ""
    found = urlsplit(value).netloc.lower() if value != "null" else "null"
    if not found or found != (request.host or "").lower():
        return (f"{name} {value[:80]!r} is not this console ({request.host!r}): requests that "
                "change something are accepted only from the console's own page")
    return ""


@web.middleware
async def _guard(request: web.Request, handler):
    """Note [Console security]: Host header on loopback, the token on every request, `?token=`
    only to set the cookie, CSRF checks on whatever changes something."""
    state: ConsoleState = request.app[STATE_KEY]
    if state.on_loopback:
        host = (request.host or "").rsplit(":", 1)[0].strip("[]") if request.host else ""
        if host and not is_loopback(host):
            raise web.HTTPForbidden(text=f"this console answers only to loopback host names "
                                    f"(127.0.0.1, localhost, ::1), not {host!r}")
    how_to = ("open the URL with ?token= that the console printed, or send 'Authorization: "
              "Bearer <token>' (the token is web.token, or the web-token file in the runtime "
              "directory; `facecast status` says where)")
    if "token" in request.query:
        # The printed link: it sets the cookie and sends the browser on without the token.
        if request.method != "GET" or not _token_matches(request.query["token"], state.token):
            raise web.HTTPUnauthorized(
                text="?token= only opens the console in a browser (GET, the right token), and "
                "then the cookie is what counts: " + how_to,
                headers={"WWW-Authenticate": "Bearer"})
        location = str(request.rel_url.without_query_params("token"))
        if location.startswith("//"):  # a path that a browser would read as another host
            location = "/" + location.lstrip("/")
        response = web.Response(status=303, headers={"Location": location,
                                                     "Cache-Control": "no-store"})
        response.set_cookie(TOKEN_COOKIE, state.token, httponly=True, samesite="Strict",
                            path="/")
        return response
    header = request.headers.get("Authorization", "")
    by_header = header.startswith("Bearer ")
    presented = header[len("Bearer "):].strip() if by_header else request.cookies.get(
        TOKEN_COOKIE, "")
    if not _token_matches(presented, state.token):
        raise web.HTTPUnauthorized(text="token required for every request: " + how_to,
                                   headers={"WWW-Authenticate": "Bearer"})
    if request.path.startswith("/api/control/") and not state.web.allow_control:
        raise web.HTTPForbidden(text="the console is read-only: set web.allow_control = true "
                                "in the config to allow reload, stop and markers")
    if request.method not in SAFE_METHODS:
        problem = _origin_problem(request, required=not by_header)
        if not problem and not by_header and request.content_type != "application/json":
            problem = (f"Content-Type {request.content_type!r}: a request that changes something "
                       "sends JSON (application/json), or the token as a Bearer header")
        if problem:
            raise web.HTTPForbidden(text=f"refused (cross-site request protection): {problem}")
    return await handler(request)


def _page(name: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / name, headers={"Cache-Control": "no-cache"})
    return handler


def _camera_id(request: web.Request) -> str:
    state: ConsoleState = request.app[STATE_KEY]
    camera_id = request.match_info["camera_id"]
    if camera_id not in state.previews:
        known = ", ".join(state.camera_ids) or "none"
        raise web.HTTPNotFound(text=f"no camera {camera_id[:64]!r} here (cameras: {known})")
    return camera_id


async def _camera_page(request: web.Request) -> web.StreamResponse:
    _camera_id(request)
    return web.FileResponse(STATIC_DIR / "camera.html", headers={"Cache-Control": "no-cache"})


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].snapshot(),
                             headers={"Cache-Control": "no-store"})


def _choice(request: web.Request, name: str, allowed: dict[str, object], default: str):
    value = request.query.get(name, default)
    if value not in allowed:
        raise web.HTTPBadRequest(text=f"{name}={value[:32]!r} is not allowed (allowed: "
                                 f"{', '.join(allowed)})")
    return allowed[value]


async def _preview(request: web.Request) -> web.Response:
    state: ConsoleState = request.app[STATE_KEY]
    camera_id = _camera_id(request)
    unknown = set(request.query) - {"size", "mesh", "token", "seq"}
    if unknown:
        raise web.HTTPBadRequest(text=f"unknown parameter(s) {', '.join(sorted(unknown))[:80]} "
                                 "(allowed: size, mesh, seq)")
    size = _choice(request, "size", {s: s for s in SIZES}, "small")
    mesh = _choice(request, "mesh", {"0": False, "1": True}, "0")
    deadline_monotonic = time.monotonic() + FRAME_WAIT_S
    state.wanted_until_monotonic[camera_id] = time.monotonic() + WANTED_FOR_S
    preview = state.previews[camera_id]
    rendered = preview.render(size, mesh, state.overlay(camera_id), state.encoder)
    while rendered is None and time.monotonic() < deadline_monotonic:
        try:
            await asyncio.wait_for(state.frame_events[camera_id].wait(),
                                   deadline_monotonic - time.monotonic())
        except asyncio.TimeoutError:
            break
        rendered = preview.render(size, mesh, state.overlay(camera_id), state.encoder)
    if rendered is None:
        raise web.HTTPServiceUnavailable(
            text=f"no frame from camera {camera_id!r} within {FRAME_WAIT_S:g} s",
            headers={"Retry-After": "1"})
    jpeg, info = rendered
    return web.Response(body=jpeg, content_type="image/jpeg", headers={
        "Cache-Control": "no-store", "X-Frame-Seq": str(info["frame_seq"]),
        "X-Capture-Ts-Lsl": repr(info["capture_ts_lsl"]), "X-Paired": str(int(info["paired"])),
        "X-Faces": json.dumps(info["faces"], separators=(",", ":"))})


async def _metrics(request: web.Request) -> web.Response:
    """Note [Metrics from the status]: the newest status in Prometheus's text format."""
    from prometheus_client import CONTENT_TYPE_LATEST

    from facecast.workers.console import metrics as console_metrics

    state: ConsoleState = request.app[STATE_KEY]
    if state.status is None:
        raise web.HTTPServiceUnavailable(text="no status from the supervisor yet",
                                         headers={"Retry-After": "1"})
    body = console_metrics.render(state.status,
                                  time.monotonic() - state.status_received_monotonic)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST,
                                            "Cache-Control": "no-store"})


async def _events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events until the client goes or falls behind (ConsoleState.broadcast)."""
    state: ConsoleState = request.app[STATE_KEY]
    queue: asyncio.Queue = asyncio.Queue(maxsize=SSE_QUEUE_MESSAGES)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-store"})
    await response.prepare(request)
    state.clients.add(queue)
    try:
        await response.write(b": facecast console\n\n")
        while queue in state.clients or not queue.empty():
            try:
                message = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
            except asyncio.TimeoutError:
                message = b": keepalive\n\n"
            await response.write(message)
            if queue not in state.clients and queue.empty():
                break  # dropped for falling behind: the browser's EventSource reconnects
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        state.clients.discard(queue)
    return response


async def _control(request: web.Request) -> web.Response:
    control: Control | None = request.app[CONTROL_KEY]
    action = request.match_info["action"]
    if action not in ("reload", "stop", "marker"):
        raise web.HTTPNotFound(text=f"no control action {action[:32]!r} (allowed: reload, stop, "
                               "marker)")
    body: dict = {}
    if action == "marker":
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # malformed, or nested past the parser's depth
            raise web.HTTPBadRequest(text='a marker is a JSON object: {"text": "..."}') from None
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str) or not text.strip() or len(text) > MARKER_TEXT_MAX:
            raise web.HTTPBadRequest(text=f'a marker is a JSON object {{"text": "..."}} with 1 to '
                                     f"{MARKER_TEXT_MAX} characters of text")
        body = {"text": text}
    if control is None:
        raise web.HTTPServiceUnavailable(text="control is not available in this console")
    ok, error = await control(action, body)
    return web.json_response({"ok": ok, "error": error}, status=200 if ok else 409)
