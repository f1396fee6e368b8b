"""The roi_landmark worker's handling of what the detection worker sends."""

from facecast.shared.messages import Detections
from facecast.workers.roi_landmark import _as_tensors


def test_a_detection_pass_that_found_no_face_is_usable():
    # Regression (found by tests/soak): an empty pass raised in reshape and crash-looped the
    # roi_landmark worker on every camera with nobody in view.
    empty = Detections(camera_id="cam", ring_epoch=1, frame_seq=3, capture_ts_lsl=1.0,
                       boxes_px=[], keypoints_px=[], scores=[])
    boxes, keypoints, scores = _as_tensors(empty)
    assert boxes.shape == (0, 4) and keypoints.shape[0] == 0 and scores.shape == (0,)
    one = Detections(camera_id="cam", ring_epoch=1, frame_seq=3, capture_ts_lsl=1.0,
                     boxes_px=[(1.0, 2.0, 30.0, 31.0)], keypoints_px=[[(5.0, 6.0)] * 6],
                     scores=[0.9])
    boxes, keypoints, scores = _as_tensors(one)
    assert boxes.shape == (1, 4) and keypoints.shape == (1, 6, 2) and scores.shape == (1,)
