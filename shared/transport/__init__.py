"""Frames between processes: rings for the pixels, ZeroMQ for the messages that name them.

A capture worker owns a `FramePublisher` per camera; every consumer (the detection and
roi_landmark workers, the console, the recorder) owns a `FrameSubscriber`, the one reader of
rings. Per camera there are two sockets under the runtime directory:

- ``frames-<camera>``: PUB → SUB. `RingDescription` whenever the ring changes (new epoch), then
  `FrameReady` for every frame. Topic = camera id.
- ``ring-<camera>``: ROUTER (publisher) ← DEALER (subscribers). `DescribeRing` from a consumer
  that joined late or missed a description; `TransportFault` from a consumer that could not prove

The package is the frame transport's every piece: the messages (`messages`), their sockets'
addresses (`endpoints`), the rings (`rings` for shared memory and the protocol, `cuda_ring` and
`cuda_driver` for CUDA IPC, `shm`), the frames' checksums (`frames`), and the two sides of a
camera's frames: `publisher` (runs in the capture worker) and `subscriber` (every consumer).
"""
