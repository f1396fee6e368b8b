"""MediaPipe's face blendshape model (face_blendshapes.tflite, from face_landmarker.task): 52
expression scores from 146 of the 478 landmarks, batched over faces (DESIGN §3).

As MediaPipe's FaceBlendshapesGraph (tasks/cc/vision/face_landmarker/face_blendshapes_graph.cc,
Apache-2.0): the landmarks of :data:`LANDMARK_SUBSET`, in that order; x and y only, in image
pixels (its LandmarksToTensorCalculator multiplies the normalised landmarks by the image size,
which is what facecast's pixel landmarks already are); one (146, 2) tensor per face. The model
centres and scales the points itself (its first operators), so nothing else is done to them; its
one output is the 52 scores in :data:`BLENDSHAPE_NAMES` order, used as they are (no top-k, no
threshold).
"""

from __future__ import annotations

import functools

import torch

from facecast.shared.face_schema import BLENDSHAPE_NAMES

# face_blendshapes_graph.cc's kLandmarksSubsetIdxs: the landmarks the model reads, in its order.
LANDMARK_SUBSET = (
    0, 1, 4, 5, 6, 7, 8, 10, 13, 14, 17, 21, 33, 37, 39, 40, 46, 52, 53, 54, 55, 58, 61, 63, 65,
    66, 67, 70, 78, 80, 81, 82, 84, 87, 88, 91, 93, 95, 103, 105, 107, 109, 127, 132, 133, 136,
    144, 145, 146, 148, 149, 150, 152, 153, 154, 155, 157, 158, 159, 160, 161, 162, 163, 168, 172,
    173, 176, 178, 181, 185, 191, 195, 197, 234, 246, 249, 251, 263, 267, 269, 270, 276, 282, 283,
    284, 285, 288, 291, 293, 295, 296, 297, 300, 308, 310, 311, 312, 314, 317, 318, 321, 323, 324,
    332, 334, 336, 338, 356, 361, 362, 365, 373, 374, 375, 377, 378, 379, 380, 381, 382, 384, 385,
    386, 387, 388, 389, 390, 397, 398, 400, 402, 405, 409, 415, 454, 466, 468, 469, 470, 471, 472,
    473, 474, 475, 476, 477,
)  # fmt: skip


@functools.lru_cache(maxsize=8)
def _subset_index(device: torch.device) -> torch.Tensor:
    # Made once per device, outside inference mode: a table made per call would be a
    # host-to-device copy each time, which a CUDA graph cannot capture.
    with torch.inference_mode(False):
        return torch.tensor(LANDMARK_SUBSET, device=device)


def model_input(landmarks_px: torch.Tensor) -> torch.Tensor:
    """(N, 478, ≥2) landmarks in image pixels → (N, 146, 2) the blendshape model's input."""
    if landmarks_px.dim() != 3 or landmarks_px.shape[1] != 478:
        raise ValueError(f"blendshapes need (faces, 478, 2 or 3) landmarks, got {tuple(landmarks_px.shape)}")
    return landmarks_px[:, _subset_index(landmarks_px.device), :2]


# Note [Blendshapes in float32]
#     The model reads landmark coordinates in frame pixels and centres them itself. In float16 a
#     coordinate between 1024 and 2048 (a 1080p frame's right half) is rounded to a whole pixel,
#     1% of a 100 px face, before any centring: eyeLook* and the mouth scores move by several
#     hundredths. The model is a small MLP-Mixer on 146 points (0.9 MB of weights, 0.064 GFLOP
#     per face against the v2 landmarker's 0.23, counted with torch's FlopCounterMode), so it
#     runs in float32 even when the pipeline's models run in float16 (FacePipeline(half=True)),
#     and its accuracy stays MediaPipe's.


def blendshapes(model: torch.nn.Module, landmarks_px: torch.Tensor,
                model_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, 52) float32 scores of the faces' landmarks (N, 478, ≥2) in image pixels
    (``model_dtype``: the model's weights' dtype; float32, Note [Blendshapes in float32])."""
    (scores, *_) = model(model_input(landmarks_px).float().to(model_dtype).contiguous())
    return scores.reshape(landmarks_px.shape[0], len(BLENDSHAPE_NAMES)).float()
