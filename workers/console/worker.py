"""The web console worker: live previews, health and the Markers log in a browser (README "Web
console", DESIGN §1). One process (`console`) for all cameras, when `web.enabled`.

Why its own process, and not part of the output worker: the output worker owns every LSL
outlet, and nothing a browser does may cost it a sample. A console inside it would share its
loop (a JPEG encode, a slow client, an aiohttp bug delaying pushes), its memory, and its fate (a
crash in the web stack would take every stream down, LSL inlets included). As a worker of its
own it is restarted by the supervisor like any other, and its crash touches nothing else.

What it reads, each the way other consumers do:
- frames: a `FrameSubscriber` (facecast.shared.transport.subscriber), like the inference
  workers, but host only (numpy frames from shm rings, torch never imported): the newest frame
  of a camera, only while a browser wants that camera's preview and at most `web.preview_fps` a
  second (`_due`); capture never waits for it, and frames it passes over are only counted;
- faces: the FaceResults the output worker received (Note [Results tap]);
- health: the supervisor's `DaemonStatus`, asked for once a second over the control socket, as
  `facecast status` does (its own DEALER: the worker's control connection speaks the worker
  protocol);
- events: the Markers stream itself, through a pylsl inlet (Note [Markers through LSL]).

Its single thread runs both: `step` drains the ZeroMQ sockets and the inlet without blocking,
then gives aiohttp's event loop a slice of time (LOOP_SLICE_S). A handler that hangs the loop
therefore silences the heartbeat, and the supervisor restarts the worker (Note [Supervisor
liveness]).

Note [Results tap]
    The roi_landmark workers' results go to one SUB socket, which the output worker binds. The
    output worker passes every message on as it came, on a PUB it binds (`endpoints.results_tap`),
    which the console subscribes to. A PUB drops what no subscriber reads and never blocks, so a
    console that is off, slow or dead costs the output worker one non-blocking send per result;
    the roi_landmark workers keep one connection each, and nothing queues up for a console that
    is not there.

Note [Markers through LSL]
    The events could come from the supervisor (a second forward beside the output worker's) or
    from the Markers stream. The console reads the stream: what it shows is then exactly what
    LabRecorder records, with the same timestamps, the supervisor gains no second delivery path
    to keep in order, and a marker the console sends (`POST /api/control/marker`) comes back on
    its own log only once it is on the stream. The inlet finds the stream by its source_id
    (`facecast-<host>-markers`); until then `/api/status` says it is looking. It says "reading"
    only once the inlet is connected: an outlet gives a new connection only what it pushes
    afterwards, so a marker sent before that is on the stream (and in LabRecorder's file) but not
    in the console's log. Events from before the console started are in the status's
    `recent_events`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import zmq

from facecast.shared import private_files
from facecast.shared.transport import endpoints, messages
from facecast.shared.transport.messages import (
    Ack,
    DaemonStatus,
    FaceResults,
    MessageGate,
    ReloadRequest,
    StatusRequest,
    StopRequest,
)
from facecast.shared.stats import StageTimer
from facecast.workers.base import BootError, Worker, results_subscriber

log = logging.getLogger(__name__)

LOOP_SLICE_S = 0.04  # aiohttp's turn per step; the step's other work is a few ms
STATUS_INTERVAL_S = 1.0
STATUS_TIMEOUT_S = 5.0  # an unanswered status request is given up and asked again
CONTROL_TIMEOUT_S = 10.0
MARKERS_RESOLVE_INTERVAL_S = 0.5
MARKERS_OPEN_TIMEOUT_S = 0.2
TOKEN_FILE = "web-token"  # in the runtime directory, mode 0600 (Note [Console security])
CONSOLE_FILE = "web-console.json"  # where the console is, for `facecast status` and tests
MARKER_EVENT = "console_marker"


class ConsoleWorker(Worker):
    role = "console"

    def boot(self) -> None:
        from aiohttp import web

        from facecast.shared.transport.subscriber import FrameSubscriber
        from facecast.workers.console.http import ConsoleState, ServerLog, build_app
        from facecast.workers.console.preview import OpenCvJpegEncoder

        web_config = self.config.web
        token, generated = resolve_token(web_config.token, Path(self.runtime_dir))
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.view = ConsoleState(self.config, self.camera_ids, OpenCvJpegEncoder(), token)
        self.timer = StageTimer()
        self._next_read_monotonic: dict[str, float] = {}
        self.subscriber = FrameSubscriber(self.context, self.runtime_dir, self.camera_ids,
                                          device=None,  # host only: no torch
                                          checksum_every=self.config.daemon.checksum_every,
                                          on_event=self.event)  # Note [Mismatches are events]
        self._results_gate = MessageGate("results tap")
        self.results = results_subscriber(self.context, rcvhwm=1000)
        self.results.connect(endpoints.results_tap(self.runtime_dir))
        self._daemon_gate = MessageGate("supervisor (status)")
        self.daemon = self.context.socket(zmq.DEALER)
        self.daemon.setsockopt(zmq.LINGER, 0)
        self.daemon.connect(self.control_endpoint)
        self._pending: dict[str, asyncio.Future] = {}
        self._status_asked: tuple[str, float] | None = None  # (message id, monotonic)
        self._next_status_monotonic = 0.0
        self.markers = MarkersReader(self.config.host())
        self.runner = web.AppRunner(build_app(self.view, self._control), access_log=None,
                                    shutdown_timeout=0.5, logger=ServerLog())
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, web_config.host, web_config.port, shutdown_timeout=0.5)
        try:
            self.loop.run_until_complete(site.start())
        except OSError as exc:
            raise BootError(
                f"web console cannot listen on {web_config.host} port {web_config.port}: "
                f"{exc.strerror or exc} (another program on that port? set web.port, 0 for any "
                "free port, or web.enabled = false)") from None
        port = self.runner.addresses[0][1]
        self.url = console_url(web_config.host, port)
        # Every request needs the token, on loopback too (Note [Console security]).
        write_console_file(Path(self.runtime_dir), {
            "url": self.url, "pid": os.getpid(), "token_required": True,
            "allow_control": web_config.allow_control,
            "token_file": "" if web_config.token else str(Path(self.runtime_dir) / TOKEN_FILE)})
        access = ("every request needs the token; control allowed" if web_config.allow_control
                  else "every request needs the token; read-only")
        log.info("web console at %s (%s)", self.url, access)
        if generated:
            # Printed once, when it is made (Note [Console security]); restarts reuse the file.
            print(f"facecast: web console token (kept in {Path(self.runtime_dir) / TOKEN_FILE}, "
                  f"mode 0600): open {self.url}?token={token}", file=sys.stderr, flush=True)

    def reassign(self, previous_camera_ids: list[str]) -> None:
        from facecast.shared.transport.subscriber import FrameSubscriber

        self.view.config = self.config  # the reload's config: it knows the added cameras
        self.view.set_cameras(self.camera_ids)
        self.subscriber.close()
        self.subscriber = FrameSubscriber(self.context, self.runtime_dir, self.camera_ids,
                                          device=None,  # host only: no torch
                                          checksum_every=self.config.daemon.checksum_every,
                                          on_event=self.event)  # Note [Mismatches are events]

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> None:
        self._read_frames()
        self._read_results()
        self._talk_to_supervisor()
        self.markers.pull(self.view)
        self.loop.run_until_complete(asyncio.sleep(LOOP_SLICE_S))

    def _due(self, camera_id: str) -> bool:
        """A camera's frame is read only while a browser asked for its preview recently, and at
        most web.preview_fps times a second (the module's docstring)."""
        now = time.monotonic()
        return (self.view.wanted(camera_id, now)
                and now >= self._next_read_monotonic.get(camera_id, 0.0))

    def _read_frames(self) -> None:
        from facecast.workers.console.preview import downscale

        for frame in self.subscriber.receive(timeout_ms=0, wanted=self._due):
            camera_id = frame.message.camera_id
            preview = self.view.previews.get(camera_id)
            if preview is None:
                continue
            self._next_read_monotonic[camera_id] = (time.monotonic()
                                                    + 1.0 / self.config.web.preview_fps)
            with self.timer.stage("preview_read"):
                image = downscale(frame.tensor, preview.sizes["large"])
            preview.add_frame(frame.message.frame_seq, frame.message.capture_ts_lsl, image)
            self.view.frame_added(camera_id)

    def _read_results(self) -> None:
        while self.results.poll(0):
            result = self._results_gate.decode(self.results.recv())
            if isinstance(result, FaceResults):
                preview = self.view.previews.get(result.camera_id)
                if preview is not None:
                    preview.add_results(result)

    def _talk_to_supervisor(self) -> None:
        self._read_replies()
        now = time.monotonic()
        if self._status_asked is not None and now - self._status_asked[1] > STATUS_TIMEOUT_S:
            log.warning("console: no status from the supervisor within %.0f s; asking again",
                        STATUS_TIMEOUT_S)
            self._status_asked = None
        if self._status_asked is None and now >= self._next_status_monotonic:
            request = StatusRequest()
            self.daemon.send(messages.encode(request), zmq.NOBLOCK)
            self._status_asked = (request.id, now)
            self._next_status_monotonic = now + STATUS_INTERVAL_S

    def _read_replies(self) -> None:
        while self.daemon.poll(0):
            reply = self._daemon_gate.decode(self.daemon.recv())
            if isinstance(reply, DaemonStatus) and self._status_asked is not None \
                    and reply.reply_to == self._status_asked[0]:
                self._status_asked = None
                self.view.set_status(msgspec_builtins(reply), time.time())
            elif isinstance(reply, Ack):
                future = self._pending.pop(reply.reply_to, None)
                if future is not None and not future.done():
                    future.set_result(reply)

    async def _control(self, action: str, body: dict) -> tuple[bool, str]:
        """POST /api/control/<action>, already checked (Note [Console security])."""
        if action == "marker":
            self.event(MARKER_EVENT, text=body["text"])
            log.info("console: marker %r sent", body["text"])
            return True, ""
        request = ReloadRequest() if action == "reload" else StopRequest()
        future = self.loop.create_future()
        self._pending[request.id] = future
        log.warning("console: %s asked for from the web console", action)
        self.daemon.send(messages.encode(request), zmq.NOBLOCK)
        try:
            reply: Ack = await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._pending.pop(request.id, None)
            return False, f"the supervisor did not answer within {CONTROL_TIMEOUT_S:g} s"
        return reply.ok, reply.error

    def stage_timings(self):
        return self.timer.timings()

    def close(self) -> None:
        remove_console_file(Path(self.runtime_dir), os.getpid())
        runner = getattr(self, "runner", None)
        if runner is not None:
            # A stop asked for from the console: the supervisor's Ack came just before our
            # SIGTERM. Resolved now, the request is answered while the server closes (it waits
            # for handlers in flight up to its shutdown_timeout), not cut off.
            self._read_replies()
            try:
                self.loop.run_until_complete(asyncio.wait_for(runner.cleanup(), 2.0))
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("console: the web server did not close cleanly: %s", exc)
        if getattr(self, "markers", None) is not None:
            self.markers.close()
        for name in ("subscriber", "results", "daemon"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        if getattr(self, "loop", None) is not None:
            self.loop.close()


class MarkersReader:
    """Note [Markers through LSL]: a pylsl inlet on this daemon's Markers stream."""

    def __init__(self, host: str) -> None:
        self.source_id = f"facecast-{host}-markers"
        self._resolver = None
        self._inlet = None
        self._subscribed = False
        self._next_look_monotonic = 0.0

    def pull(self, state) -> None:
        import pylsl

        if self._inlet is None:
            now = time.monotonic()
            if now < self._next_look_monotonic:
                return
            self._next_look_monotonic = now + MARKERS_RESOLVE_INTERVAL_S
            if self._resolver is None:
                self._resolver = pylsl.ContinuousResolver(
                    pred=f"source_id='{self.source_id}'", forget_after=5.0)
            found = self._resolver.results()
            if not found:
                return
            # recover=True: the inlet finds the outlet again after an output worker restart.
            self._inlet = pylsl.StreamInlet(found[0], max_buflen=60, recover=True)
            self._resolver = None  # its background queries are no longer needed
        if not self._subscribed:
            # An inlet connects lazily, and an outlet gives a new connection only what it pushes
            # afterwards: until open_stream returns, a marker sent now would never come back
            # here. So "reading" is said only once the connection is made (a local one takes
            # milliseconds; on a timeout the next pull tries again).
            try:
                self._inlet.open_stream(timeout=MARKERS_OPEN_TIMEOUT_S)
            except pylsl.util.TimeoutError:  # pylsl's own class, not the builtin
                state.markers_note = f"connecting to {self.source_id}"
                return
            self._subscribed = True
            state.markers_note = f"reading {self.source_id}"
            log.info("console: reading the Markers stream %s", self.source_id)
        samples, stamps = self._inlet.pull_chunk(timeout=0.0)
        for sample, stamp in zip(samples, stamps):
            state.add_marker(sample[0], stamp)

    def close(self) -> None:
        # An inlet with recover=True keeps resolving a gone outlet for as long as it exists.
        if self._inlet is not None:
            self._inlet.close_stream()
            self._inlet = None
            self._subscribed = False
        self._resolver = None


# --- the console's files in the runtime directory ------------------------------------------------


def resolve_token(configured: str, runtime_dir: Path) -> tuple[str, bool]:
    """(the token, whether it was generated now): `web.token`, else the one in TOKEN_FILE, else
    a new one written there (Note [Console security]). An existing file is trusted only in a
    runtime directory that is this user's alone, and only if it is this user's regular file with
    mode 0600 (Note [Private files]): another user who could
    plant it would know the token. One that is not is replaced, and the log says why. A new
    file is 0600 from its creation on (O_EXCL, then renamed into place)."""
    unsafe_dir = private_files.runtime_dir_problem(runtime_dir)
    if unsafe_dir:  # the supervisor checked it; it changed since, or this is not its directory
        raise BootError(f"web console: not keeping a token in {runtime_dir}: {unsafe_dir}")
    if configured:
        return configured, False
    path = runtime_dir / TOKEN_FILE
    existing = ""
    if os.path.lexists(path):
        unsafe_file = private_files.file_problem(path)
        if unsafe_file:
            log.warning("console: not trusting the token in %s, replacing it: %s", path,
                        unsafe_file)
        else:
            existing = path.read_text().strip()
            if len(existing) < 16:
                log.warning("console: the token in %s is shorter than 16 characters; replacing "
                            "it", path)
    if len(existing) >= 16:
        return existing, False
    token = secrets.token_urlsafe(24)
    # 0600 from its creation; replaces a link or a foreign file itself, never its target.
    private_files.write_atomically(path, (token + "\n").encode())
    return token, True


def console_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()  # every address: name the machine, not "any"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def write_console_file(runtime_dir: Path, fields: dict) -> None:
    path = runtime_dir / CONSOLE_FILE
    temporary = path.with_name(f".{CONSOLE_FILE}.{os.getpid()}")
    temporary.write_text(json.dumps(fields) + "\n")
    os.replace(temporary, path)


def remove_console_file(runtime_dir: Path, pid: int) -> None:
    """Only this process's: a console that ended after its successor started leaves that one's."""
    path = runtime_dir / CONSOLE_FILE
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def read_console_file(runtime_dir: str | Path) -> dict | None:
    """Where the running daemon's console is (for `facecast status`); None without one."""
    try:
        return json.loads((Path(runtime_dir) / CONSOLE_FILE).read_text())
    except (OSError, ValueError):
        return None


def msgspec_builtins(status: DaemonStatus) -> dict:
    import msgspec

    return msgspec.to_builtins(status)
