"""Face embeddings (models/face_embedding.py) against dlib itself (``dlib-bin``, test-only), on
real photos (astronaut, grace_hopper) and mirrored and scaled versions of them:

- the network: dlib's ``compute_face_descriptor`` and facecast's module on the same 150x150
  chips: cosine distance ≤ 1e-3 (the issue's bar);
- the chip: facecast's sampling from dlib's own 5 points against ``dlib.get_face_chip``;
- the full path: facecast's chips from its own mesh (FaceLandmarker's 478 points) against dlib's
  alignment from its 5-point predictor: the same photo close, the same person within dlib's
  0.6, the two people beyond it;
- a damaged model file is refused with the file and the reason.

The figures are printed (``-s``) for the README's parity table.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from facecast.models import assets
from facecast.models import face_embedding as fe
from facecast.models.roi import FrameBatch

dlib = pytest.importorskip("dlib", reason="dlib-bin (the test extra) is the reference implementation")

COSINE_DISTANCE_MAX = 1e-3
SAME_PHOTO_DISTANCE_MAX = 0.2  # mesh alignment vs dlib's, same image (measured ≤ 0.13)
SAME_POINTS_DISTANCE_MAX = 0.02  # facecast's chip vs dlib's from the same points, no shrink
SHRUNK_SAME_POINTS_DISTANCE_MAX = 0.06  # ... where dlib uses its pyramid (shrink > 2)


@pytest.fixture(scope="module")
def model_files(embedding_network, model_dir):
    torch.set_num_threads(1)  # as the other model tests: 2 cores shared with a busy process
    return embedding_network, assets.shape_predictor_path(model_dir)


@pytest.fixture(scope="module")
def embedder(model_files):
    return fe.FaceEmbedder(model_files[0], "cpu")


@pytest.fixture(scope="module")
def cases(photos, model_files, landmarker_bundle):
    """Per image: the RGB pixels, dlib's 5 points, chip and descriptor, and facecast's mesh."""
    from facecast.models.pipeline import FacePipeline

    network_path, predictor_path = model_files
    detector = dlib.get_frontal_face_detector()
    predictor = dlib.shape_predictor(str(predictor_path))
    recognizer = dlib.face_recognition_model_v1(str(network_path))
    pipeline = FacePipeline("cpu", max_faces=1, face_landmarker_task=landmarker_bundle.task_path)
    found = {}
    for person, rgb in photos.items():
        for variant, image in (("", rgb), ("_mirror", rgb[:, ::-1]),
                               ("_x1.6", cv2.resize(rgb, None, fx=1.6, fy=1.6, interpolation=cv2.INTER_LINEAR)),
                               ("_x0.6", cv2.resize(rgb, None, fx=0.6, fy=0.6, interpolation=cv2.INTER_AREA))):
            image = np.ascontiguousarray(image)
            faces = pipeline([np.ascontiguousarray(image[..., ::-1])])[0]
            assert len(faces) == 1, f"facecast finds {len(faces)} faces in {person}{variant}"
            # dlib's HOG detector also fires on the astronaut's flag patch: take its box nearest
            # to facecast's face.
            boxes = detector(image, 1 if max(image.shape) <= 640 else 0)
            centre = faces[0].landmarks[:, :2].mean(axis=0)
            box = min(boxes, key=lambda b: np.hypot(b.center().x - centre[0], b.center().y - centre[1]))
            assert box.contains(dlib.point(int(centre[0]), int(centre[1]))), f"dlib misses the face in {person}{variant}"
            shape = predictor(image, box)
            found[person + variant] = {
                "person": person, "rgb": image,
                "points": np.array([[shape.part(i).x, shape.part(i).y] for i in range(5)], np.float32),
                "chip": dlib.get_face_chip(image, shape, size=fe.CHIP_SIZE_PX, padding=fe.CHIP_PADDING),
                "dlib": np.array(recognizer.compute_face_descriptor(image, shape)),
                "landmarks": faces[0].landmarks,
            }
    return found


def _cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_the_network_matches_dlib_on_the_same_chips(cases, embedder, model_files):
    recognizer = dlib.face_recognition_model_v1(str(model_files[0]))
    names = list(cases)
    chips = np.stack([cases[name]["chip"] for name in names])
    ours = embedder.embed_chips(torch.from_numpy(chips)).numpy()  # one batch of all the chips
    assert ours.shape == (len(names), fe.EMBEDDING_SIZE) and ours.dtype == np.float32
    worst = 0.0
    for name, vector in zip(names, ours):
        reference = np.array(recognizer.compute_face_descriptor(cases[name]["chip"]))
        cosine, euclidean = _cosine_distance(vector, reference), float(np.linalg.norm(vector - reference))
        print(f"{name:20s} cosine distance {cosine:.2e}  euclidean {euclidean:.2e}")
        assert cosine <= COSINE_DISTANCE_MAX, name
        worst = max(worst, cosine)
    print(f"max cosine distance to dlib on the same chips: {worst:.2e} over {len(names)} chips")


def test_chips_from_dlibs_points_are_dlibs_chips(cases, embedder):
    for name, case in cases.items():
        frames = FrameBatch([case["rgb"]], "cpu", bgr=False)
        points = torch.from_numpy(case["points"])[None]
        chip = fe.extract_chips(frames, torch.zeros(1), points)[0]
        _, shrink = fe.chip_rects(points)
        vector = embedder.embed_chips(chip[None])[0].numpy()
        distance = float(np.linalg.norm(vector - case["dlib"]))
        pixel_error = np.abs(chip.numpy() - case["chip"]).mean()
        print(f"{name:20s} shrink {shrink.item():.2f}  mean |pixel difference| {pixel_error:.2f}  "
              f"distance to dlib {distance:.4f}")
        # The GPU's path (K×K samples for every face, no look at the shrink) gives the same chip.
        rects, spacing = fe.chip_rects(points)
        spread = ((spacing - fe.ANTIALIAS_FROM_SHRINK)
                  / (fe.ANTIALIAS_FULL_AT_SHRINK - fe.ANTIALIAS_FROM_SHRINK)).clamp(0.0, 1.0)
        everywhere = fe._supersampled(frames, torch.zeros(1, dtype=torch.long), rects, spacing, spread,
                                      fe.ANTIALIAS_SAMPLES)[0]
        assert torch.allclose(everywhere, chip, atol=1e-3), name
        if shrink.item() <= fe.ANTIALIAS_FROM_SHRINK:
            # dlib's chip is our bilinear samples truncated to uint8: 0.5 on average.
            assert pixel_error <= 0.6, name
            assert distance <= SAME_POINTS_DISTANCE_MAX, name
        else:
            assert distance <= SHRUNK_SAME_POINTS_DISTANCE_MAX, name


def test_embeddings_from_the_mesh_tell_the_two_people_apart(cases, embedder):
    names = list(cases)
    frames = FrameBatch([cases[name]["rgb"] for name in names], "cpu", bgr=False)
    landmarks = torch.from_numpy(np.stack([cases[name]["landmarks"] for name in names]))
    ours = embedder.embed_landmarks(frames, torch.arange(len(names)), landmarks).numpy()
    print("euclidean distance, facecast (mesh alignment; rows) to dlib (5-point alignment; columns)")
    print(" " * 20 + " ".join(f"{name[:12]:>12s}" for name in names))
    same_photo, same_person, other_person = [], [], []
    for i, name in enumerate(names):
        row = []
        for reference_name in names:
            distance = float(np.linalg.norm(ours[i] - cases[reference_name]["dlib"]))
            row.append(distance)
            if reference_name == name:
                same_photo.append(distance)
            elif cases[reference_name]["person"] == cases[name]["person"]:
                same_person.append(distance)
            else:
                other_person.append(distance)
        print(f"{name:20s}" + " ".join(f"{d:12.3f}" for d in row))
    print(f"same photo: max {max(same_photo):.3f}; same person: max {max(same_person):.3f}; "
          f"other person: min {min(other_person):.3f} (dlib's threshold {fe.SAME_PERSON_DISTANCE})")
    assert max(same_photo) <= SAME_PHOTO_DISTANCE_MAX
    assert max(same_person) < fe.SAME_PERSON_DISTANCE
    assert min(other_person) > fe.SAME_PERSON_DISTANCE
    # Among facecast's own embeddings too (what a gallery compares).
    distances = torch.cdist(torch.from_numpy(ours), torch.from_numpy(ours)).numpy()
    people = np.array([cases[name]["person"] for name in names])
    same = people[:, None] == people[None, :]
    assert distances[same].max() < fe.SAME_PERSON_DISTANCE < distances[~same].min()


def test_a_batch_across_frames_gives_each_face_its_own_embedding(cases, embedder):
    names = ["astronaut", "grace_hopper_x0.6"]  # frames of different sizes in one batch
    frames = FrameBatch([np.ascontiguousarray(cases[n]["rgb"][..., ::-1]) for n in names], "cpu")  # BGR
    landmarks = torch.from_numpy(np.stack([cases[n]["landmarks"] for n in names]))
    together = embedder.embed_landmarks(frames, torch.tensor([0, 1]), landmarks)
    for i, name in enumerate(names):
        alone = embedder.embed_landmarks(FrameBatch([cases[name]["rgb"]], "cpu", bgr=False),
                                         torch.zeros(1), landmarks[i:i + 1])
        assert torch.allclose(together[i], alone[0], atol=1e-5), name
    empty = embedder.embed_landmarks(frames, torch.zeros(0), torch.zeros(0, 478, 3))
    assert empty.shape == (0, fe.EMBEDDING_SIZE)
    with pytest.raises(ValueError, match="478"):
        fe.mesh_chip_points(torch.zeros(2, 5, 2))


def test_a_damaged_model_file_is_refused_with_the_reason(tmp_path, model_files):
    original = model_files[0].read_bytes()

    def refused(data: bytes, name: str) -> str:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(fe.EmbeddingModelInvalid) as caught:
            fe.load_dlib_face_resnet(path)
        message = str(caught.value)
        assert str(path) in message and "dlib's face recognition ResNet" in message
        return message

    assert "truncated" in refused(original[:len(original) // 2], "half.dat")
    assert "truncated" in refused(original[:-1], "one_byte_short.dat")
    assert "follow the network" in refused(original + b"\0", "trailing.dat")
    # A layer record of another type where a convolution belongs (the first con_4 renamed).
    first_con = original.index(b"con_4")
    assert "'cox_4'" in refused(original[:first_con] + b"cox_4" + original[first_con + 5:], "other.dat")
    # Not a dlib file at all: zeros are no valid integer control byte.
    assert "does not start" in refused(bytes(1000), "zeros.dat")
    # dlib's 5-point shape predictor is a dlib file too, but not this network.
    assert "at byte" in refused(model_files[1].read_bytes()[:4096], "predictor.dat")
    with pytest.raises(assets.ModelMissing, match="facecast models install"):
        fe.load_dlib_face_resnet(tmp_path / "absent.dat")
