"""Faces drawn into a frame: a box, the track id and the participant's name, where a FaceResults
says they are. One drawing for the web console's previews (facecast.workers.console.preview) and
the recorder's burned-in overlays (facecast.workers.recorder.worker, `record.overlays`), so that a
video and a preview of the same frame show the same thing.

Runs in the console worker and in the recorder worker's encoder threads (OpenCV's drawing
releases no shared state: one image per call).
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from facecast.shared.transport.messages import FaceResults

LANDMARK_COUNT = 478

BOX_BGR = (80, 220, 80)
MESH_BGR = (255, 200, 80)
TEXT_BGR = (255, 255, 255)
SHADOW_BGR = (0, 0, 0)


def line_thickness_px(image_width_px: int) -> int:
    """Lines one pixel wide per 320 pixels of image width."""
    return max(1, round(image_width_px / 320))


def draw_faces(image: np.ndarray, results: FaceResults | None, scale: float,
               thickness_px: int, mesh: bool = False) -> list[dict]:
    """Each face of `results` (frame pixels, times `scale` for this image) drawn into `image`:
    its box, `#<track id>` and the participant's name when it has one, optionally the mesh.
    Returns the faces drawn, in this image's pixels."""
    width = image.shape[1]
    drawn = []
    for face in (results.faces if results is not None else []):
        x1, y1, x2, y2 = (value * scale for value in face.box_px)
        if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
            continue
        cv2.rectangle(image, (round(x1), round(y1)), (round(x2), round(y2)), BOX_BGR,
                      thickness_px, cv2.LINE_AA)
        text = f"#{face.track_id} {face.participant}" if face.participant else f"#{face.track_id}"
        label(image, text, (round(x1), max(12, round(y1) - 4)), width)
        if mesh and face.landmarks_px is not None:
            points = np.frombuffer(face.landmarks_px, dtype="<f4").reshape(LANDMARK_COUNT, 3)
            for x, y in (points[:, :2] * scale).round().astype(np.int32):
                cv2.circle(image, (int(x), int(y)), 0, MESH_BGR, -1)
        drawn.append({"track_id": face.track_id, "participant": face.participant,
                      "box_px": [x1, y1, x2, y2]})
    return drawn


def label(image: np.ndarray, text: str, origin: tuple[int, int], width: int) -> None:
    """White text with a black outline, readable on any background; sized to the image."""
    scale = max(0.35, width / 1280)
    for color, extra in ((SHADOW_BGR, 2), (TEXT_BGR, 0)):
        cv2.putText(image, text, origin, cv2.FONT_HERSHEY_SIMPLEX, scale, color,
                    max(1, round(scale * 2)) + extra, cv2.LINE_AA)
