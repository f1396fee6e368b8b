"""`facecast transport-check`: prove the frame transport between two fresh processes, as doctor will.

This process plays a capture worker (a `FramePublisher`); a freshly spawned interpreter plays a
consumer (a `FrameSubscriber` that checks every frame's checksum and compares every byte). The
report says which transport each requested mode ends up on and why.
"""

from __future__ import annotations

import multiprocessing
import queue
import tempfile
import time

import numpy as np
import zmq

FRAME_SHAPE = (720, 1280, 3)
FRAMES = 60


def _consume(runtime_dir: str, results: multiprocessing.Queue) -> None:
    # ---- runs in the spawned consumer process ----
    import torch

    from facecast.shared.transport.subscriber import FrameSubscriber

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    deck = [torch.from_numpy(rng.integers(0, 256, FRAME_SHAPE, dtype=np.uint8)).to(device)
            for _ in range(3)]
    verified = wrong = 0
    with zmq.Context() as context:
        subscriber = FrameSubscriber(context, runtime_dir, ["check"], device=device, checksum_every=1)
        results.put("ready")
        deadline = time.monotonic() + 30
        last_seq = -1
        while time.monotonic() < deadline and last_seq < FRAMES - 1:
            for frame in subscriber.receive(100):
                last_seq = frame.message.frame_seq
                same = torch.equal(frame.tensor, deck[last_seq % 3])
                verified += same
                wrong += not same
        status = subscriber.status["check"]
        results.put({"verified": verified, "wrong": wrong, "transport": status.transport,
                     "reason": status.fallback_reason, "counts": dict(status.counts)})
        subscriber.close()


def check(requested: str) -> dict:
    """Send FRAMES random 720p frames over `requested` transport to a fresh process."""
    from facecast.shared.transport.publisher import FramePublisher

    spawn = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    results = spawn.Queue()
    rng = np.random.default_rng(0)
    deck = [rng.integers(0, 256, FRAME_SHAPE, dtype=np.uint8) for _ in range(3)]
    with tempfile.TemporaryDirectory(prefix="fc-check-") as runtime_dir, zmq.Context() as context:
        consumer = spawn.Process(target=_consume, args=(runtime_dir, results), daemon=True)
        consumer.start()
        publisher = FramePublisher(context, runtime_dir, "check", transport=requested)
        try:
            if results.get(timeout=60) != "ready":
                raise RuntimeError("consumer did not start")
            time.sleep(0.3)
            for index in range(FRAMES):
                publisher.publish(deck[index % 3], time.monotonic())
                time.sleep(1 / 30)
            for _ in range(20):
                publisher.serve_control()
                time.sleep(0.05)
            report = results.get(timeout=30)
        except queue.Empty:
            report = {"error": "the consumer process did not report within 30 s"}
        finally:
            consumer.join(timeout=5)
            if consumer.is_alive():
                consumer.kill()
            report_producer = publisher.status
            publisher.close()
    report["requested"] = requested
    report["producer_transport"] = report_producer.transport
    report["producer_reason"] = report_producer.fallback_reason
    return report


def main(transports: list[str]) -> int:
    failures = 0
    for requested in transports:
        report = check(requested)
        ok = "error" not in report and report["wrong"] == 0 and report["verified"] > 0
        failures += not ok
        reason = report.get("reason") or report.get("producer_reason") or ""
        print(f"{requested:>8}: {'ok' if ok else 'FAILED'}; frames on {report.get('transport') or '?'}"
              f", {report.get('verified', 0)} verified byte for byte, {report.get('wrong', 0)} wrong"
              + (f"; shm because: {reason}" if reason else "")
              + (f"; {report['error']}" if "error" in report else ""))
    return 1 if failures else 0
