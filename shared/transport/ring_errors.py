"""`TransportUnavailable`, in a module of its own so that the ring modules import one way only.

rings.py (the ring protocol and the shm ring), cuda_ring.py (the CUDA ring) and cuda_driver.py
(the CUDA driver) all raise it. When it lived in rings.py, cuda_driver.py imported rings.py
while rings.py reached back into cuda_driver.py (pinning) and cuda_ring.py (opening a reader),
a cycle held apart only by imports inside functions. Now the graph has one direction:
publisher.py, subscriber.py -> cuda_ring.py -> rings.py -> cuda_driver.py -> ring_errors.py. The
imports of cuda_driver.py and cuda_ring.py that remain inside functions are there so that a
capture worker on shm never imports torch or PyCUDA, not to break a cycle.
"""

from __future__ import annotations


class TransportUnavailable(RuntimeError):
    """This process cannot use a ring of this transport; the message is the reason (for status)."""
