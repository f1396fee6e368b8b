"""The order in which a GPU's workers start streaming (Note [Boot order]): the supervisor holds
a device's capture workers until its inference workers are up. Runs in the supervisor.

Note [Boot order]
    On the CPU every worker starts at once. On a GPU, a device's capture workers stream only once
    its detection and roi_landmark workers have booted. Those prepare a CUDA graph for every batch
    size they can meet (Note [Warm shapes]): thousands of short kernels and syncs, each of which
    waits for the GPU's time slice among every context on the device. With the capture workers
    already streaming (64 cameras on the H200: 8 capture contexts, 2 inference workers), the
    detection worker's graphs took 45 s and READY came after 51 s. Started on a quiet GPU, the
    inference workers are then there for the first frames; nothing is lost, since no frame
    exists before capture starts.
    Capture workers are started at once all the same, *held* (Assignment.hold): they prepare
    (imports, torch and the CUDA context: 4.8 s of the 5.6-8.3 s a capture worker of 8 cameras
    took to boot on the H200, then serial after the detection worker's 23 s) while the inference
    workers boot (and make their replayed cameras' loops: Note [Loops made while held]), and
    open their sources and stream when the supervisor sends Release. A held worker's boot is
    timed (daemon.boot_timeout_s) from its release; until then, once it has prepared, it is
    judged by its heartbeats, as a running worker is, so that inference slower than the boot
    timeout does not get it killed. A capture worker started later (a restart) is
    not held.
"""

from __future__ import annotations

import time

from facecast.daemon.layout import WorkerSpec
from facecast.daemon.process import GIVEN_UP_STATES, WorkerState
from facecast.shared.transport.messages import Release


class BootOrder:
    """Which capture workers wait for their device's inference (`held`), which of them were told
    so in their Assignment (`told`: they wait for a Release), and their release."""

    def __init__(self, workers, control) -> None:
        self.workers = workers  # the supervisor's WorkerTable
        self.control = control  # its ControlSocket, for Release
        self.held: list[WorkerSpec] = []
        self.told: set[str] = set()

    def hold_captures(self, specs: list[WorkerSpec]) -> None:
        """At the daemon's start: on a GPU, capture streams once the device's inference is up."""
        self.held = [s for s in specs if s.role == "capture" and s.device != "cpu"]

    def holds(self, spec: WorkerSpec) -> bool:
        """Whether the worker's Assignment tells it to wait (and that it was told so)."""
        hold = any(held.name == spec.name for held in self.held)
        if hold:
            self.told.add(spec.name)
            worker = self.workers.get(spec.name)
            if worker is not None:
                worker.held = True
        return hold

    def release_captures_when_inference_is_up(self) -> None:
        """Each tick: release the held captures of every device whose detection and roi_landmark
        workers are running (or were given up on)."""
        if not self.held:
            return
        inference_devices = {w.spec.device for w in self.workers
                             if w.spec.role in ("detection", "roi_landmark") and not w.spec.standby
                             and w.state is not WorkerState.RUNNING
                             and w.state not in GIVEN_UP_STATES}
        waiting = []
        for spec in self.held:
            if spec.device in inference_devices:
                waiting.append(spec)
            elif spec.name in self.told:
                self.told.discard(spec.name)
                worker = self.workers.get(spec.name)
                if worker is not None and worker.state is WorkerState.BOOTING:
                    worker.held = False
                    worker.started_monotonic = time.monotonic()  # its boot is timed from here
                    self.control.send_to(spec.name, Release(worker=spec.name))
            # else: its Hello has not come yet, and its Assignment will not hold it
        self.held = waiting
