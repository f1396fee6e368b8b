"""A worker as a process (workers/__main__.py, workers/base.py): its titles in `ps` and `top`
(STYLE §12), which follow a promoted standby's new name, and the stack dump that a SIGABRT
from the supervisor leaves in the log (Note [Stack dumps of a hung worker]).

Real processes: `python -m facecast.workers` with a ROUTER playing the supervisor, and a minimal
process stuck in C code that holds the GIL."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import zmq

from facecast.shared import config as config_mod
from facecast.shared.transport import messages
from facecast.shared.exit_codes import EXIT_BOOT_ERROR
from facecast.shared.transport.messages import Assignment, Heartbeat, Hello, Promote
from facecast.workers import base
from facecast.workers.base import COMM_BYTES, process_titles


def test_exit_codes_have_one_home():
    assert base.EXIT_BOOT_ERROR is EXIT_BOOT_ERROR == 3


@pytest.mark.parametrize("name, title, short", [
    ("capture:synth0", "facecast.capture:synth0", "fc.cap:synth0"),
    ("output", "facecast.output", "fc.out"),
    ("detection:cuda:0", "facecast.detection:cuda:0", "fc.det:cuda:0"),
    ("roi_landmark:cuda:0:1", "facecast.roi_landmark:cuda:0:1", "fc.roi:cuda:0:1"),
    ("standby:roi_landmark:cpu", "facecast.standby:roi_landmark:cpu", "fc.sb.roi:cpu"),
    # Too long for the kernel's 15 bytes: the end of the camera's name is what tells apart.
    ("capture:lab_camera_left", "facecast.capture:lab_camera_left", "fc.cap:era_left"),
    ("capture:kamera_süd", "facecast.capture:kamera_süd", "fc.cap:era_süd"),  # ü: 2 bytes
    ("capture:xüabcdefg", "facecast.capture:xüabcdefg", "fc.cap:abcdefg"),  # no half ü
])
def test_process_titles(name, title, short):
    assert process_titles(name) == (title, short)
    assert len(short.encode()) <= COMM_BYTES


def test_short_titles_of_cameras_that_differ_at_the_end_differ():
    # Regression: prctl's first 15 bytes of `fc.capture:synth0` and `...:synth1` were equal.
    shorts = {process_titles(f"capture:synth{k}")[1] for k in range(2)}
    assert len(shorts) == 2


# --- real worker processes ------------------------------------------------------------------------


@pytest.fixture
def supervisor(runtime_dir):
    """A ROUTER where the supervisor's control socket would be, and a way to start workers."""
    endpoint = f"ipc://{runtime_dir}/control"
    started: list[subprocess.Popen] = []
    with zmq.Context() as context:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.bind(endpoint)

        def start(role: str, name: str, stderr_path: Path) -> subprocess.Popen:
            with open(stderr_path, "w") as stderr:
                process = subprocess.Popen(
                    [sys.executable, "-m", "facecast.workers", role, name, endpoint],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                    preexec_fn=_no_core_file)
            started.append(process)
            return process

        def receive(timeout_ms: int = 30_000):
            assert router.poll(timeout_ms), "the worker said nothing"
            identity, payload = router.recv_multipart()
            return identity, messages.decode(payload)

        try:
            yield router, start, receive
        finally:
            for process in started:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=30)
            router.close()


def _no_core_file() -> None:
    # A SIGABRT's default action may write a core file; a test has no use for it.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _titles(pid: int) -> tuple[str, str]:
    """(the command line as `ps` shows it, the kernel's name as `top` shows it)."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    return (cmdline.split(b"\0")[0].decode().strip(),
            Path(f"/proc/{pid}/comm").read_text().strip())


def test_titles_name_the_worker_and_follow_a_promoted_standby(supervisor, tmp_path):
    router, start, receive = supervisor
    spare = start("capture", "standby:capture:cpu", tmp_path / "stderr.txt")
    identity, hello = receive()
    assert isinstance(hello, Hello) and hello.pid == spare.pid
    assert _titles(spare.pid) == ("facecast.standby:capture:cpu", "fc.sb.cap:cpu")
    config = config_mod.loads('[[cameras]]\nid = "cam1"\nsource = "synthetic"\n')
    router.send_multipart([identity, messages.encode(Assignment(
        worker=hello.worker, config=msgspec.json.encode(config), camera_ids=[], standby=True))])
    while not (isinstance(message := receive()[1], Heartbeat) and message.state == "standby"):
        pass
    router.send_multipart([identity, messages.encode(Promote(worker="capture:cam1"))])
    identity, hello = receive()
    assert identity == b"capture:cam1" and isinstance(hello, Hello)
    assert _titles(spare.pid) == ("facecast.capture:cam1", "fc.cap:cam1")


@pytest.mark.parametrize("role, name", [("capture", "capture:cam0"),
                                        ("roi_landmark", "roi_landmark:cpu:0")])
def test_sigabrt_dumps_the_stack_of_a_worker_that_waits(supervisor, tmp_path, role, name):
    # The real entry point enables the dumps: a worker stuck waiting (here for its Assignment,
    # in zmq's poll) shows where, in the log, when the supervisor gives up on it. roi_landmark:
    # torch, imported after the dumps were enabled, leaves them in place.
    router, start, receive = supervisor
    stderr_path = tmp_path / "stderr.txt"
    worker = start(role, name, stderr_path)
    receive()  # its Hello: it now waits for an Assignment that never comes
    worker.send_signal(signal.SIGABRT)
    assert worker.wait(timeout=30) == -signal.SIGABRT
    stderr = stderr_path.read_text()
    assert "Fatal Python error: Aborted" in stderr, stderr
    assert "most recent call first" in stderr
    assert f"workers{os.sep}base.py" in stderr and "in wait_for_assignment" in stderr, stderr
    assert "__main__.py" in stderr and "in main" in stderr, stderr


HUNG_CHILD = textwrap.dedent("""
    import re
    import threading

    from facecast.workers.base import enable_stack_dumps

    enable_stack_dumps()
    started = threading.Event()


    def beside_the_hang():
        lock = threading.Lock()
        lock.acquire()
        started.set()
        lock.acquire()  # forever


    def hang_in_native_code_holding_the_gil():
        print("hanging", flush=True)
        # Catastrophic backtracking: 2**64 steps inside the C regex engine, which never lets go
        # of the GIL, so no Python-level signal handler could ever run now.
        re.match(r"(a+)+$", "a" * 64 + "b")


    threading.Thread(target=beside_the_hang, daemon=True).start()
    started.wait()
    hang_in_native_code_holding_the_gil()
""")


def test_sigabrt_dumps_every_thread_of_a_process_stuck_in_c_holding_the_gil(tmp_path):
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", HUNG_CHILD], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=stderr, text=True,
                                 preexec_fn=_no_core_file)
    try:
        assert child.stdout.readline() == "hanging\n", stderr_path.read_text()
        child.send_signal(signal.SIGABRT)
        assert child.wait(timeout=30) == -signal.SIGABRT
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        child.stdout.close()
    stderr = stderr_path.read_text()
    assert "Fatal Python error: Aborted" in stderr, stderr
    current = stderr.index("Current thread")
    assert "in hang_in_native_code_holding_the_gil" in stderr[current:], stderr
    assert "in beside_the_hang" in stderr[:current], stderr  # the other thread, too


def test_sigterm_before_the_loop_ends_the_boot_at_once(supervisor, tmp_path):
    # A boot has no loop to look at the stop flag and may take tens of seconds (CUDA graphs on
    # a busy GPU); here the worker waits for an Assignment (ASSIGNMENT_TIMEOUT_S) that never
    # comes. SIGTERM must end it now, cleanly, so the supervisor never needs SIGKILL.
    router, start, receive = supervisor
    stderr_path = tmp_path / "stderr.txt"
    worker = start("capture", "capture:cam0", stderr_path)
    receive()  # its Hello
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=base.ASSIGNMENT_TIMEOUT_S / 3) == 0, stderr_path.read_text()
    assert "stopped while booting" in stderr_path.read_text()


def test_workers_start_with_expandable_segments_unless_the_allocator_is_set():
    """Note [Expandable segments]: the default for a worker, never over a setting of the user's."""
    from facecast.workers.__main__ import use_expandable_segments

    plain = {"PATH": "/usr/bin"}
    use_expandable_segments(plain)
    assert plain["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        chosen = {name: "max_split_size_mb:128"}
        use_expandable_segments(chosen)
        assert chosen == {name: "max_split_size_mb:128"}
