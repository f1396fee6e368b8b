"""Real producer and consumer processes for the transport tests and benchmarks.

    python tests/peers.py producer --runtime-dir D --camera cam0 --frames 1000 --fps 200 ...
    python tests/peers.py consumer --runtime-dir D --camera cam0 --until-seq 999 ...
    python tests/peers.py tamper --description F --slot 3 --change patch   # a third process

Frames are drawn from a small deck of random frames made from a seed, so a consumer in another
process can check every byte of every frame it receives against what the producer wrote. The
consumer prints one JSON line with what it saw. Processes are separate interpreters (never
forked), as in the daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import subprocess
import time
import traceback
from pathlib import Path

import numpy as np
import zmq

PEERS_SCRIPT = Path(__file__).resolve()
DECK_SIZE = 7  # prime, so a stale slot of an 8-slot ring never holds the expected frame


class Peers:
    def __init__(self, runtime_dir: str) -> None:
        self.runtime_dir = runtime_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, role: str, **options) -> subprocess.Popen:
        """A peer process; a consumer once it has subscribed (it says so)."""
        (proc,) = self.start_many(1, role, **options)
        return proc

    def start_many(self, count: int, role: str, **options) -> list[subprocess.Popen]:
        """`count` peers of one role started side by side (each consumer's imports take a
        while), returned once every consumer has subscribed."""
        argv = [sys.executable, str(PEERS_SCRIPT), role, "--runtime-dir", self.runtime_dir]
        for key, value in options.items():
            flag = "--" + key.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(count)]
        self.procs += procs
        if role == "consumer":
            for proc in procs:
                assert self.next_line(proc) == {"ready": True}
        return procs

    @staticmethod
    def next_line(proc: subprocess.Popen) -> dict:
        """The next JSON line a peer printed (before its result: `ready`, `first_frame`)."""
        line = proc.stdout.readline()
        assert line, f"peer exited with {proc.wait()} before saying more"
        return json.loads(line)

    @staticmethod
    def result(proc: subprocess.Popen, timeout_s: float = 60) -> dict:
        out, _ = proc.communicate(timeout=timeout_s)
        assert proc.returncode == 0, f"peer exited with {proc.returncode}: {out}"
        return json.loads(out.strip().splitlines()[-1])

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def make_deck(seed: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(DECK_SIZE)]


def run_producer(args) -> None:
    from facecast.shared.transport.publisher import FramePublisher

    deck = make_deck(args.seed, args.shape)
    faults = {}
    if args.delay_copy_cycles:
        faults["delay_copy_cycles"] = args.delay_copy_cycles
    cuda_options = {}
    if faults:
        from facecast.shared.transport.cuda_ring import CudaFaults

        cuda_options["faults"] = CudaFaults(**faults)
    with zmq.Context() as context:
        publisher = FramePublisher(
            context, args.runtime_dir, args.camera, slot_count=args.slots,
            transport=args.transport, checksum_kind=args.checksum_kind, **cuda_options,
        )
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            deadline = time.monotonic() + args.start_delay_s
            while time.monotonic() < deadline:  # let subscribers connect before frame 0
                publisher.serve_control()
                time.sleep(0.005)
            period_s = 1.0 / args.fps if args.fps > 0 else 0.0
            next_monotonic = time.monotonic()
            for index in range(args.frames):
                if args.corrupt_at == index:
                    publisher.corrupt_next_frame()
                publisher.publish(deck[publisher.frame_seq % DECK_SIZE], time.monotonic())
                if index == 0 and args.description_out:  # for a third process (tamper-loop)
                    from facecast.shared.transport import messages

                    path = Path(args.description_out)
                    path.with_suffix(".tmp").write_bytes(
                        messages.encode(publisher.producer.description()))
                    path.with_suffix(".tmp").rename(path)
                    # Frame 1 on only once the third process writes into the ring: its attach
                    # (torch, a CUDA context) can take longer than the whole run of frames.
                    ready = path.with_name(path.name + ".attached")
                    ready_deadline = time.monotonic() + args.timeout_s
                    while not ready.exists() and time.monotonic() < ready_deadline:
                        publisher.serve_control()
                        time.sleep(0.005)
                    next_monotonic = time.monotonic()
                # Like a camera, never two frames back to back to make up for a late one: a
                # consumer handed two frames at once reads only the newer (the first corruption
                # loads a kernel, which once made frame corrupt_at late and then skipped).
                next_monotonic += period_s
                if time.monotonic() > next_monotonic:  # late: a whole period to the next one
                    next_monotonic = time.monotonic() + period_s
                while (pause := next_monotonic - time.monotonic()) > 0:
                    publisher.serve_control()
                    time.sleep(min(pause, 0.002))
            print(json.dumps({"published": args.frames, "transport": publisher.status.transport,
                              "fallbacks": publisher.status.fallbacks,
                              "fallback_reason": publisher.status.fallback_reason}), flush=True)
            linger_deadline = time.monotonic() + args.linger_s
            while time.monotonic() < linger_deadline:
                publisher.serve_control()
                time.sleep(0.01)
        finally:
            publisher.close()


def run_consumer(args) -> None:
    """Every frame it is handed checked byte for byte against the deck. On `--device host` (the
    default) a host-only subscriber reads numpy copies and torch is never imported, as in the
    recorder and the console: a CPU consumer's checks are those of a CPU inference worker (Note
    [The consumer's own copy]), and four of them start in a fraction of the time (importing
    torch costs ~1.5 s of CPU each, the suite's 2 minutes, issue 20). `--device cpu` or `cuda`:
    torch tensors on that device."""
    from facecast.shared.transport.subscriber import FrameSubscriber

    deck = make_deck(args.seed, args.shape)
    if args.device == "host":
        device = None
        deck_on_device = deck
        equal_frames = np.array_equal
    else:
        import torch

        device = torch.device(args.device)
        deck_on_device = [torch.from_numpy(frame).to(device) for frame in deck]
        equal_frames = torch.equal
    received = mismatched = 0
    epochs: list[int] = []
    transports: list[str] = []
    last_seq = first_seq = -1
    with zmq.Context() as context:
        subscriber = FrameSubscriber(
            context, args.runtime_dir, [args.camera], device=device,
            checksum_every=args.checksum_every,
            **({"unsafe_skip_event_wait": True} if args.skip_event_wait else {}),
        )
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # report what was seen, then exit
        print(json.dumps({"ready": True}), flush=True)
        deadline = time.monotonic() + args.timeout_s
        try:
            while (time.monotonic() < deadline and last_seq < args.until_seq
                   and not _asked_to_stop(args)):
                for frame in subscriber.receive(timeout_ms=50):
                    seq = frame.message.frame_seq
                    if first_seq < 0 and args.say_first_frame:
                        print(json.dumps({"first_frame": seq}), flush=True)
                    first_seq = seq if first_seq < 0 else first_seq
                    if args.slow_s:
                        time.sleep(args.slow_s)
                    equal = equal_frames(frame.tensor, deck_on_device[seq % DECK_SIZE])
                    if device is not None and device.type == "cuda":
                        torch.cuda.current_stream(device).synchronize()
                    received += 1
                    mismatched += not equal
                    last_seq = max(last_seq, seq)
                    status = subscriber.status[args.camera]
                    if not epochs or epochs[-1] != status.ring_epoch:
                        epochs.append(status.ring_epoch)
                        transports.append(status.transport)
        finally:
            status = subscriber.status[args.camera]
            print(json.dumps({
                "received": received, "mismatched": mismatched, "last_seq": last_seq,
                "first_seq": first_seq,
                "epochs": epochs, "ipc_opens": _ipc_opens(),
                "transports": transports, "counts": dict(status.counts),
                "fallback_reason": status.fallback_reason, "fallbacks": status.fallbacks,
            }), flush=True)
            subscriber.close()


def _asked_to_stop(args) -> bool:
    """Whether the test made the --stop-file: end the loop and report."""
    return bool(args.stop_file) and Path(args.stop_file).exists()


def _ipc_opens() -> int:
    module = sys.modules.get("facecast.shared.transport.cuda_ring")
    return module.CudaRingReader.opens_total if module else 0


def run_attach(args) -> None:
    """Open the ring described in a file, as a fresh process would; report the verdict."""
    from facecast.shared.transport import messages
    from facecast.shared.transport.ring_errors import TransportUnavailable
    from facecast.shared.transport.subscriber import open_reader

    description = messages.decode(open(args.description, "rb").read())
    try:
        reader = open_reader(description, device=None if args.device == "host" else args.device)
    except TransportUnavailable as exc:
        cause = exc.__cause__ or exc.__context__
        detail = "".join(traceback.format_exception(cause)) if cause else ""
        print(json.dumps({"ok": False, "reason": str(exc), "detail": detail}), flush=True)
        return
    print(json.dumps({"ok": True, "open_ms": getattr(reader, "open_ms", 0.0)}), flush=True)
    reader.close()


TAMPER_CHANGES = ("byte", "patch", "whole")
PATCH_SIDE = 16


def tampered(pixels, change: str, position: int, seed: int):
    """What a third process writes over a published frame (`pixels`: the slot's frame bytes as a
    frame-shaped uint8 array or tensor, changed in place): one byte at `position` (of the frame's
    bytes) inverted; a 16x16 patch whose first pixel is that byte's pixel, every byte changed; or
    the whole frame replaced by other random bytes. Returns the (row, column) of a patch."""
    flat = pixels.reshape(-1)
    if change == "byte":
        flat[position] = 255 - int(flat[position])
        return None
    if change == "patch":
        height, width = pixels.shape[:2]
        pixel = position // pixels.shape[2]
        row = min(pixel // width, height - PATCH_SIDE)
        column = min(pixel % width, width - PATCH_SIDE)
        patch = pixels[row:row + PATCH_SIDE, column:column + PATCH_SIDE]
        patch[...] = 255 - patch  # every byte differs from what was published
        return row, column
    other = np.random.default_rng(seed).integers(0, 256, flat.shape[0], dtype=np.uint8)
    other[0] = 255 - int(flat[0])  # certainly not the frame that was there
    if isinstance(flat, np.ndarray):
        flat[...] = other
    else:
        import torch

        flat.copy_(torch.from_numpy(other))
    return None


@contextlib.contextmanager
def foreign_slots(description):
    """The ring's frame slots as a third process maps them, through its shm name or its CUDA IPC
    handle (never the producer's pointer): (a frame-shaped view per slot, a function that waits
    until the writes are in memory)."""
    shape = tuple(description.frame_shape)
    frame_bytes = int(np.prod(shape))
    if description.transport == "shm":
        from facecast.shared.transport import shm

        size_bytes = description.slot_bytes * (description.slot_count + 1)
        segment = shm.SharedSegment.attach(description.data_name, size_bytes)
        try:
            slots = np.frombuffer(segment.buffer, np.uint8).reshape(description.slot_count + 1, -1)
            views = [slots[slot, :frame_bytes].reshape(shape)
                     for slot in range(description.slot_count)]
            yield views, lambda: None
            del views, slots  # no export of the mapping may outlive it
        finally:
            segment.close()
        return
    import torch

    from facecast.shared.transport.cuda_ring import CudaRingReader

    reader = CudaRingReader(description)  # opens the IPC handle: another process (rule 6)
    try:
        assert CudaRingReader.opens_total == 1, "the tamperer must map the ring through IPC"
        yield ([reader.slots[slot, :frame_bytes].view(shape)
                for slot in range(description.slot_count)],
               lambda: torch.cuda.synchronize(reader.device_index))
    finally:
        reader.close()


def run_tamper(args) -> None:
    """A third process: attach the ring described in a file (`foreign_slots`), change a
    published slot, and say so once the change is in memory. It reads no message: what a buggy
    or hostile process with the handle can do."""
    from facecast.shared.transport import messages

    description = messages.decode(open(args.description, "rb").read())
    with foreign_slots(description) as (views, sync):
        tampered(views[args.slot], args.change, args.position, args.seed)
        sync()
    print(json.dumps({"tampered": args.change, "slot": args.slot}), flush=True)


def run_tamper_loop(args) -> None:
    """A third process that keeps writing into a ring for `--timeout-s` seconds once attached (or
    until its --stop-file exists): it waits for the description file, attaches the ring as
    `tamper` does (and says so with a file beside it, for the producer), then cycles through
    every slot (the one the producer is filling included, whichever that is), changing each as
    `--change` says at a position that moves from change to change. What a buggy or hostile
    writer with the ring's name or handle does all the time, not once."""
    from facecast.shared.transport import messages

    path = Path(args.description)
    wait_deadline = time.monotonic() + 60.0
    while not path.exists():
        if time.monotonic() > wait_deadline:
            raise SystemExit(f"no ring description at {path}")
        time.sleep(0.01)
    description = messages.decode(path.read_bytes())
    frame_bytes = int(np.prod(description.frame_shape))
    rng = np.random.default_rng(args.seed)
    changes = 0
    with foreign_slots(description) as (views, sync):
        # Writing from now on: the producer (with --description-out) goes on past frame 0.
        path.with_name(path.name + ".attached").touch()
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline and not _asked_to_stop(args):
            for view in views:
                tampered(view, args.change, int(rng.integers(0, frame_bytes)),
                         int(rng.integers(0, 2**31)))
                changes += 1
            sync()
            time.sleep(args.slow_s)
    print(json.dumps({"changes": changes}), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["producer", "consumer", "attach", "tamper",
                                         "tamper-loop"])
    parser.add_argument("--description", help="attach: file holding an encoded RingDescription")
    parser.add_argument("--description-out", default="",
                        help="producer: write the ring's description here after frame 0, and "
                        "publish frame 1 once FILE.attached exists (the tamper-loop made it)")
    parser.add_argument("--runtime-dir", default="")
    parser.add_argument("--camera", default="cam0")
    parser.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split(",")),
                        default=(120, 160, 3))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--fps", type=float, default=100.0)
    parser.add_argument("--start-delay-s", type=float, default=0.5)
    parser.add_argument("--linger-s", type=float, default=0.5)
    parser.add_argument("--delay-copy-cycles", type=int, default=0)
    parser.add_argument("--corrupt-at", type=int, default=-1)
    parser.add_argument("--device", default="host",
                        help="consumer: host (numpy, no torch), cpu or cuda (torch tensors); "
                        "attach: cpu or cuda")
    parser.add_argument("--checksum-every", type=int, default=1)
    parser.add_argument("--checksum-kind", choices=["full", "sampled"], default="full")
    parser.add_argument("--until-seq", type=int, default=10**9)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--skip-event-wait", action="store_true")
    parser.add_argument("--stop-file", default="",
                        help="consumer, tamper-loop: end the loop (and report) once FILE exists")
    parser.add_argument("--say-first-frame", action="store_true",
                        help="consumer: print {\"first_frame\": seq} once a frame came")
    parser.add_argument("--slot", type=int, default=0, help="tamper: the slot to change")
    parser.add_argument("--change", choices=TAMPER_CHANGES, default="byte")
    parser.add_argument("--position", type=int, default=0,
                        help="tamper: the frame byte changed (byte), or the patch's first pixel's")
    args = parser.parse_args(argv)
    {"producer": run_producer, "consumer": run_consumer, "attach": run_attach,
     "tamper": run_tamper, "tamper-loop": run_tamper_loop}[args.role](args)


if __name__ == "__main__":
    main()
