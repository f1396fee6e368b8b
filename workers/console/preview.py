"""The web console's previews: a camera's recent frames, downscaled, paired with the faces
measured on them, drawn on and JPEG-encoded (facecast.workers.console.worker).

Runs in the console worker only.

Note [Preview pairing]
    A preview shows a frame with the faces measured on *that* frame: the results of a frame
    arrive after the frame itself (detection, mesh and tracking take tens to hundreds of
    milliseconds), so a box drawn on the newest frame would lag behind the face it belongs to.
    So each camera keeps its last PREVIEW_HISTORY_S of downscaled frames, and a preview is the
    newest of them whose frame_seq has results; when none has (the camera has no measuring
    worker, or every result was lost), it is the newest frame, labelled "no results", rather
    than a frame with somebody else's boxes.

Note [JPEG encoder]
    Encoding goes through `JpegEncoder`, whose one implementation is OpenCV's on the CPU. A
    camera whose frames are in GPU memory (a CUDA IPC ring) is downscaled there before its small
    image comes to the CPU (`downscale`), so the only copy across PCIe is the preview's own. An
    nvJPEG encoder (torchvision.io.encode_jpeg on the device, or nvImageCodec) would slot in as a
    second implementation; none is here because nothing on this project's CPU machines could
    verify it.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import cv2
import numpy as np

from facecast.shared.transport.messages import FaceResults
from facecast.workers.face_drawing import draw_faces, label, line_thickness_px

if TYPE_CHECKING:
    import torch

PREVIEW_HISTORY_S = 2.0  # Note [Preview pairing]: covers the pipeline's latency on a busy CPU
RESULTS_KEPT = 256  # per camera, by frame_seq
JPEG_QUALITY = 80
SIZES = ("small", "large")  # the grid's preview and a camera page's (twice the width)


class JpegEncoder(Protocol):
    """Note [JPEG encoder]: BGR uint8 (H, W, 3) → JPEG bytes."""

    name: str

    def encode(self, image_bgr: np.ndarray) -> bytes: ...


class OpenCvJpegEncoder:
    name = "opencv"

    def __init__(self, quality: int = JPEG_QUALITY) -> None:
        self._params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)]

    def encode(self, image_bgr: np.ndarray) -> bytes:
        ok, buffer = cv2.imencode(".jpg", image_bgr, self._params)
        if not ok:
            raise RuntimeError(f"OpenCV could not encode a {image_bgr.shape} image as JPEG")
        return buffer.tobytes()


def preview_size(camera_width: int, camera_height: int, width: int) -> tuple[int, int]:
    """(width, height) of a preview `width` pixels wide (never wider than the camera's frames),
    keeping the camera's aspect; both even, as JPEG's chroma subsampling likes them."""
    width = min(width, camera_width)
    height = max(2, round(camera_height * width / camera_width / 2) * 2)
    return max(2, width // 2 * 2), height


def downscale(tensor: torch.Tensor | np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A frame (H, W, 3 uint8: a numpy array, or a tensor on the CPU or a GPU) as a BGR numpy
    image of `size` (w, h). On a GPU it is downscaled there (Note [JPEG encoder]); on the CPU
    by OpenCV's area filter."""
    if isinstance(tensor, np.ndarray):
        return cv2.resize(tensor, size, interpolation=cv2.INTER_AREA)
    if tensor.is_cuda:
        import torch.nn.functional as F

        chw = tensor.permute(2, 0, 1).unsqueeze(0).float()
        small = F.interpolate(chw, size=(size[1], size[0]), mode="area")
        return small[0].permute(1, 2, 0).round().clamp(0, 255).to(dtype=tensor.dtype).cpu().numpy()
    return cv2.resize(tensor.numpy(), size, interpolation=cv2.INTER_AREA)


@dataclass
class PreviewFrame:
    frame_seq: int
    capture_ts_lsl: float
    image_bgr: np.ndarray  # the "large" size; the grid's is made from it


@dataclass
class Overlay:
    """What is written on a preview besides the faces."""

    transport: str = ""
    fps: float = 0.0


class CameraPreview:
    """One camera's recent frames and results (Note [Preview pairing]) and its encoded previews.
    Frames are added by the console's frame loop; `render` is called for HTTP requests."""

    def __init__(self, camera_id: str, width: int, height: int, preview_width: int,
                 preview_fps: float) -> None:
        self.camera_id = camera_id
        self.camera_size = (width, height)
        self.sizes = {"small": preview_size(width, height, preview_width),
                      "large": preview_size(width, height, 2 * preview_width)}
        self.frames: collections.deque[PreviewFrame] = collections.deque(
            maxlen=max(2, math.ceil(PREVIEW_HISTORY_S * preview_fps)))
        self.results: collections.OrderedDict[int, FaceResults] = collections.OrderedDict()
        self.frames_read = 0
        self._cache: dict[tuple[str, bool], tuple[int, bytes, dict]] = {}

    def add_frame(self, frame_seq: int, capture_ts_lsl: float, image_bgr: np.ndarray) -> None:
        if self.frames and frame_seq < self.frames[-1].frame_seq:
            self.frames.clear()  # a capture restart counts from 0 again: the old ones are stale
        self.frames.append(PreviewFrame(frame_seq, capture_ts_lsl, image_bgr))
        self.frames_read += 1

    def add_results(self, results: FaceResults) -> None:
        self.results[results.frame_seq] = results
        self.results.move_to_end(results.frame_seq)
        while len(self.results) > RESULTS_KEPT:
            self.results.popitem(last=False)

    def newest_paired(self) -> tuple[PreviewFrame | None, FaceResults | None]:
        """Note [Preview pairing]: the newest frame with its own results, else the newest frame."""
        for frame in reversed(self.frames):
            results = self.results.get(frame.frame_seq)
            if results is not None and results.capture_ts_lsl == frame.capture_ts_lsl:
                return frame, results
        return (self.frames[-1] if self.frames else None), None

    def render(self, size: str, mesh: bool, overlay: Overlay,
               encoder: JpegEncoder) -> tuple[bytes, dict] | None:
        """(JPEG, what it shows) of the newest paired frame; None before the first frame.
        Encoded once per frame, size and mesh choice, whichever number of browsers ask."""
        frame, results = self.newest_paired()
        if frame is None:
            return None
        key = (size, mesh)
        cached = self._cache.get(key)
        if cached is not None and cached[0] == frame.frame_seq:
            return cached[1], cached[2]
        width, height = self.sizes[size]
        image = frame.image_bgr
        if image.shape[1] != width:
            image = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
        else:
            image = image.copy()
        faces = draw(image, results, self.camera_size, mesh, overlay)
        jpeg = encoder.encode(image)
        info = {"frame_seq": frame.frame_seq, "capture_ts_lsl": frame.capture_ts_lsl,
                "paired": results is not None, "faces": faces, "width": width, "height": height}
        self._cache[key] = (frame.frame_seq, jpeg, info)
        return jpeg, info


def draw(image: np.ndarray, results: FaceResults | None, camera_size: tuple[int, int],
         mesh: bool, overlay: Overlay) -> list[dict]:
    """The faces (facecast.workers.face_drawing: the recorder's overlays draw the same) and the
    camera's transport and fps, drawn into `image` (a preview of a frame of `camera_size`); the
    faces drawn, in preview pixels."""
    height, width = image.shape[:2]
    drawn = draw_faces(image, results, width / camera_size[0], line_thickness_px(width), mesh)
    status = f"{overlay.transport or '-'}  {overlay.fps:.1f} fps"
    if results is None:
        status += "  no results"
    label(image, status, (4, height - 6), width)
    return drawn
