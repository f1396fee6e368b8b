"""MediaPipe FaceLandmarker's own landmark model (``face_landmarks_detector.tflite`` of
face_landmarker.task, the "v2" landmarker trained together with the blendshape model): its
input and the decoding of its outputs (DESIGN §3).

As MediaPipe's FaceLandmarksDetectorGraph and TensorsToFaceLandmarksGraph
(tasks/cc/vision/face_landmarker/, Apache-2.0): the ROI (the same rotated square, 1.5x the face,
as the attention mesh's) is warped to 256x256 RGB with values 0..1 and the border replicated
(ImageToTensorCalculator's defaults with the model's normalisation metadata); the model's first
output is the 478 landmarks (x, y, z) in input pixels, irises included (no refinement heads);
its second, a logit of face presence (sigmoid, threshold 0.5). Projecting the points back into
the frame is the same as for the attention mesh (models/roi.py ``project_points``).
"""

from __future__ import annotations

import torch

INPUT_PX = 256
NUM_LANDMARKS = 478
MODEL_NAME = "face_landmarks_detector"


def decode(outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``face_landmarks_detector``'s outputs (landmarks (N, 1, 1, 1434), presence logit
    (N, 1, 1, 1), and a third head facecast does not use) → (N, 478, 3) landmarks in model-input
    pixels and (N,) face presence probabilities."""
    if len(outputs) < 2:
        raise ValueError(f"face_landmarks_detector has at least 2 outputs, got {len(outputs)}")
    landmarks, presence_logit = outputs[0], outputs[1]
    count = landmarks.shape[0]
    if landmarks[0].numel() != NUM_LANDMARKS * 3:
        raise ValueError(f"face_landmarks_detector's first output has {landmarks[0].numel()} values "
                         f"per face, expected {NUM_LANDMARKS} x 3: is it face_landmarker.task's?")
    return (landmarks.reshape(count, NUM_LANDMARKS, 3).float(),
            torch.sigmoid(presence_logit.reshape(count).float()))
