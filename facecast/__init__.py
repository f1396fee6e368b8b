"""facecast: faces from many cameras, measured on the GPU, published as LSL streams.

The code is laid out by role (see DESIGN.md §1):

- ``facecast.daemon``  — the supervisor, its control socket and the CLI;
- ``facecast.workers`` — capture, detection, ROI/landmark and output worker processes;
- ``facecast.shared``  — what crosses process boundaries: config, messages, frame rings;
- ``facecast.models``  — MediaPipe's models converted to PyTorch, and the face pipeline.
"""

__version__ = "0.1.0"
