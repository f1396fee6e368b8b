"""Note [Transport reasons]: every ring a camera gets comes with the reason
it got it, which the capture worker's `transport` marker carries; none is empty."""

from __future__ import annotations

import numpy as np
import zmq

from facecast.shared.transport.cuda_driver import cuda_unavailable_reason
from facecast.shared.transport.publisher import FramePublisher


def ring_reasons(runtime_dir, shapes, **options) -> list[tuple[str, str]]:
    """(transport, reason) of each ring the publisher made while publishing frames of `shapes`."""
    seen = []
    with zmq.Context() as context:
        publisher = FramePublisher(context, runtime_dir, "cam0", slot_count=2, **options)
        try:
            for shape in shapes:
                publisher.publish(np.zeros(shape, np.uint8), 0.0)
                status = publisher.status
                if not seen or seen[-1][2] != status.ring_epoch:
                    seen.append((status.transport, status.reason, status.ring_epoch))
        finally:
            publisher.close()
    return [(transport, reason) for transport, reason, _ in seen]


def test_shm_asked_for_says_so_and_a_new_frame_size_says_why_a_new_ring(runtime_dir):
    rings = ring_reasons(runtime_dir, [(8, 8, 3), (8, 8, 3), (16, 8, 3)], transport="shm")
    assert rings == [
        ("shm", 'transport "shm" was asked for'),
        ("shm", 'frames changed from 8x8x3 to 16x8x3: a new ring; transport "shm" was asked for'),
    ]


def test_the_callers_own_reason_for_shm_is_the_rings_reason(runtime_dir):
    why = 'transport "auto", but models run on the CPU: shared memory saves a copy'
    assert ring_reasons(runtime_dir, [(8, 8, 3)], transport="shm",
                        transport_reason=why) == [("shm", why)]


def test_auto_says_why_it_is_cuda_or_why_not(runtime_dir):
    [(transport, reason)] = ring_reasons(runtime_dir, [(8, 8, 3)], transport="auto")
    unavailable = cuda_unavailable_reason()
    if unavailable is not None:  # this machine: no CUDA, so the reason is why not
        assert (transport, reason) == ("shm", unavailable)
    else:
        assert transport == "cuda_ipc" and reason == 'transport "auto": a CUDA IPC ring on GPU 0'
