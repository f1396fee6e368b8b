"""Face embeddings: dlib's face recognition ResNet in PyTorch, fed from facecast's own mesh.

The network is ``dlib_face_recognition_resnet_model_v1.dat`` (Davis King, CC0; 128-D, 99.38% on
LFW), read by :mod:`facecast.models.dlib_serialization` (no dlib at run time) and rebuilt as a
torch module, :class:`DlibFaceResNet`. Its input is dlib's "face chip": a 150x150 RGB crop
aligned by a similarity transform on five face points, with 25% padding; :func:`extract_chips`
cuts those chips out of a :class:`~facecast.models.roi.FrameBatch` in one batched gather, from
the 478-point mesh the roi_landmark stage already has (Note [Chip points from the mesh]).

Use (any device, float32, batched over faces of any frames)::

    embedder = FaceEmbedder.from_model_dir(device="cuda")      # or FaceEmbedder(path, device)
    vectors = embedder.embed_landmarks(frames, frame_index, landmarks_px)   # (N, 128)
    same = torch.linalg.vector_norm(vectors[0] - vectors[1]) < SAME_PERSON_DISTANCE  # Euclidean

:meth:`FaceEmbedder.embed_chips` takes ready chips (dlib's ``get_face_chip`` output, for one).
Two embeddings of one person are within :data:`SAME_PERSON_DISTANCE` (dlib's 0.6, Euclidean) of
each other; the vectors are dlib's own, not normalised (norms of about 1.4 on the test photos).

Note [dlib's face ResNet]
    ``anet_type`` of dlib's ``dnn_face_recognition_ex.cpp`` (also in the Python bindings'
    ``face_recognition.cpp``): input 150x150 RGB, ``(pixel − mean) / 256`` with the per-channel
    means stored in the file; con 7x7/2 (32) → affine → relu → max_pool 3x3/2; then residual
    units of two 3x3 convolutions, each followed by a per-channel affine (batch norm frozen into
    ``gamma·x + beta`` at training time), a relu between them and after the sum: 3 units of 32,
    4 of 64, 3 of 128, 3 of 256 and one more of 256, the first unit of each width after 32
    a "down" unit (first convolution stride 2, shortcut ``avg_pool 2x2/2``); then the spatial
    mean and a 128x256 linear layer without bias. dlib's defaults fix the padding: a stride-1
    convolution pads by half its kernel, a strided one and the pools not at all. Its
    ``add_prev`` sums tensors of different shapes by treating the missing elements as zeros
    (``tt::add``): the shortcut of 32 channels fills the first 32 of the 64, and where the
    strided branch is smaller than the pooled shortcut (8x8 → 3x3 against 4x4), the sum has
    the larger size with the branch in its top-left corner. :func:`_add_like_dlib` does the same.
    Each affine is folded into the convolution before it (``w·gamma``, ``b·gamma + beta``):
    one pass less, and the same function to float rounding.

Note [Chip points from the mesh]
    dlib's chip (``get_face_chip_details`` with 5 points, size 150, padding 0.25) fits a
    similarity transform from five template points to the image points of its 5-point shape
    predictor: the outer and inner corners of the subject's left eye (image right), of the
    right eye, and the bottom of the nose (subnasale). Those are points of the mesh:
    263 and 362 (left eye, outer then inner corner: the canthi of MediaPipe's eye contours),
    33 and 133 (right eye), and 2 (the point under the nose tip where the columella meets the
    lip, the mesh's subnasale; 1 and 4 are on the tip, 94 just above 2). dlib's template places
    the 5 points where the 68-point iBUG mean shape has the eye corners (36/39/42/45) and point
    33 (subnasale), which is the same anatomy. So the alignment needs no extra model: the chips
    come from facecast's landmarks (the mesh's x, y in frame pixels).

Note [Sampling dlib's chip]
    dlib maps chip pixel (u, v) to the image at ``c + R(θ)·((u − (S−1)/2)·k, (v − (S−1)/2)·k)``
    with ``k = (S·scale − 1)/(S−1)``: the fitted transform gives the angle θ, the scale and the
    centre c = transform(S/2, S/2) of a square ``centered_drect`` of side S·scale (whose corners
    are S·scale − 1 apart), and dlib puts those corners on the first and last chip pixels. :func:`chip_rects` turns that into
    :class:`RotatedRects` for :func:`~facecast.models.roi.crop_rois`, which samples bilinearly
    as dlib does; outside the frame the chip is black (dlib: 0), except that crop_rois
    replicates the edge for samples within half a pixel of it. When the chip shrinks the face
    by more than 2 (a face of more than ~300 px between the padded chip's sides), dlib first
    halves the image with its 5-tap pyramid filter, to keep bilinear sampling from aliasing;
    this module instead averages K×K bilinear samples per chip pixel, spread over a fraction of
    the chip pixel that grows from 0 at a shrink factor of 1.5 to the whole pixel at 2.5 (a box
    filter as wide as the chip pixel is in the frame). Below 1.5 the chips are dlib's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from facecast.models import assets
from facecast.models.dlib_serialization import DlibFormatError, Layer, Spec, read_network
from facecast.models.roi import FrameBatch, RotatedRects, crop_rois

log = logging.getLogger(__name__)

CHIP_SIZE_PX = 150
CHIP_PADDING = 0.25  # dlib's face_recognition_model_v1 default
EMBEDDING_SIZE = 128
SAME_PERSON_DISTANCE = 0.6  # dlib's threshold on the Euclidean distance (LFW: 99.38%)

# Note [Chip points from the mesh]: in the order of dlib's 5-point model.
MESH_CHIP_POINT_INDICES = (263, 362, 33, 133, 2)

# dlib's get_face_chip_details, 5 points: the template in the unit square of the unpadded face.
_DLIB_CHIP_TEMPLATE = np.array([[0.8595674595992, 0.2134981538014],
                                [0.6460604764104, 0.2289674387677],
                                [0.1205750620789, 0.2137274526848],
                                [0.3340850613712, 0.2290642403242],
                                [0.4901123135679, 0.6277975316475]])

# Note [Sampling dlib's chip]
ANTIALIAS_SAMPLES = 4  # K: K×K samples per chip pixel when the face is shrunk
ANTIALIAS_FROM_SHRINK = 1.5
ANTIALIAS_FULL_AT_SHRINK = 2.5


class EmbeddingModelInvalid(assets.ModelError):
    """The file is not dlib's face recognition network (damaged, truncated, another model)."""


# ---------------------------------------------------------------------------------------------
# The network's type (Note [dlib's face ResNet]), as dlib_serialization reads it.


def _block(filters: int, stride: int, below: list[Spec]) -> list[Spec]:
    # block<N,BN,stride,SUBNET> = BN<con<N,3,3,1,1,relu<BN<con<N,3,3,stride,stride,SUBNET>>>>>
    return [Spec("affine"), Spec("con", {"filters": filters, "kernel": 3, "stride": 1}), Spec("relu"),
            Spec("affine"), Spec("con", {"filters": filters, "kernel": 3, "stride": stride})] + below


def _ares(filters: int, below: list[Spec]) -> list[Spec]:
    # relu<add_prev1<block<N,affine,1,tag1<SUBNET>>>>
    return [Spec("relu"), Spec("add_prev", {"id": 1})] + _block(filters, 1, [Spec("tag", {"id": 1})] + below)


def _ares_down(filters: int, below: list[Spec]) -> list[Spec]:
    # relu<add_prev2<avg_pool<2,2,2,2,skip1<tag2<block<N,affine,2,tag1<SUBNET>>>>>>>
    return [Spec("relu"), Spec("add_prev", {"id": 2}), Spec("avg_pool", {"window": 2, "stride": 2}),
            Spec("skip", {"id": 1}), Spec("tag", {"id": 2})] + _block(filters, 2, [Spec("tag", {"id": 1})] + below)


def anet_specs() -> list[Spec]:
    """dlib's ``anet_type``, outermost first (what :func:`read_network` walks)."""
    net = [Spec("max_pool", {"window": 3, "stride": 2}), Spec("relu"), Spec("affine"),
           Spec("con", {"filters": 32, "kernel": 7, "stride": 2}),
           Spec("input_rgb_image_sized", {"size": CHIP_SIZE_PX})]
    for filters, units, down in ((32, 3, False), (64, 4, True), (128, 3, True), (256, 3, True), (256, 1, True)):
        for unit in range(units):
            net = _ares_down(filters, net) if down and unit == 0 else _ares(filters, net)
    return [Spec("loss_metric"), Spec("fc", {"outputs": EMBEDDING_SIZE, "bias": False}),
            Spec("avg_pool", {"window": 0, "stride": 1})] + net


# ---------------------------------------------------------------------------------------------
# The torch module


def _add_like_dlib(branch: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
    """dlib's add_prev: the sum over the larger shape, missing elements zero (Note [dlib's face
    ResNet]); zero padding goes after the last channel, row and column."""
    channels = max(branch.shape[1], shortcut.shape[1])
    rows = max(branch.shape[2], shortcut.shape[2])
    cols = max(branch.shape[3], shortcut.shape[3])

    def grow(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1:] == (channels, rows, cols):
            return x
        return F.pad(x, (0, cols - x.shape[3], 0, rows - x.shape[2], 0, channels - x.shape[1]))

    return grow(branch) + grow(shortcut)


def _conv(con: Layer, affine: Layer | None) -> nn.Conv2d:
    weight = torch.from_numpy(con.fields["weight"].copy())
    out_channels, in_channels, kernel, _ = weight.shape
    bias = con.fields["bias"]
    bias = torch.from_numpy(bias.copy()) if bias is not None else torch.zeros(out_channels)
    if affine is not None and not affine.fields["disabled"]:  # fold gamma·(conv + b) + beta
        gamma = torch.from_numpy(affine.fields["gamma"].copy())
        beta = torch.from_numpy(affine.fields["beta"].copy())
        if gamma.numel() != out_channels:
            raise DlibFormatError(f"affine of {gamma.numel()} channels after a con of {out_channels}",
                                  affine.offset_bytes)
        weight = weight * gamma[:, None, None, None]
        bias = bias * gamma + beta
    padding_y, padding_x = con.fields["padding"]
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride=con.fields["stride"],
                     padding=(padding_y, padding_x))
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
    return conv


class _ResidualUnit(nn.Module):
    def __init__(self, first: nn.Conv2d, second: nn.Conv2d, downsample: bool):
        super().__init__()
        self.first = first
        self.second = second
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.second(F.relu(self.first(x)))
        shortcut = F.avg_pool2d(x, 2, 2) if self.downsample else x
        return F.relu(_add_like_dlib(branch, shortcut))


class DlibFaceResNet(nn.Module):
    """dlib's face recognition ResNet (Note [dlib's face ResNet]).

    ``forward(chips)``: chips (N, 150, 150, 3), RGB, values 0..255 (uint8 or float) →
    (N, 128) float32 descriptors, dlib's ``compute_face_descriptor`` for the same chips.
    """

    def __init__(self, layers: list[Layer]):
        super().__init__()
        walk = iter(layers)
        layer = next(walk)
        self.register_buffer("mean_rgb", torch.tensor(layer.fields["mean_rgb"], dtype=torch.float32))
        stem_con, stem_affine, relu, pool = (next(walk) for _ in range(4))
        self._expect([stem_con, stem_affine, relu, pool], ["con", "affine", "relu", "max_pool"])
        self.stem = _conv(stem_con, stem_affine)
        self.stem_pool = (pool.fields["window"], pool.fields["stride"])
        units = []
        for layer in walk:
            if layer.kind == "avg_pool":  # avg_pool_everything: the residual units are done
                break
            # tag1, [con, affine, relu, con, affine], then (down units) tag2 skip1 avg_pool,
            # then add_prev, relu.
            self._expect([layer], ["tag"])
            body = [next(walk) for _ in range(5)]
            self._expect(body, ["con", "affine", "relu", "con", "affine"])
            following = next(walk)
            downsample = following.kind == "tag"
            if downsample:
                tail = [following, next(walk), next(walk), next(walk), next(walk)]
                self._expect(tail, ["tag", "skip", "avg_pool", "add_prev", "relu"])
            else:
                self._expect([following, next(walk)], ["add_prev", "relu"])
            units.append(_ResidualUnit(_conv(body[0], body[1]), _conv(body[3], body[4]), downsample))
        self.units = nn.Sequential(*units)
        fc = next(walk)
        self._expect([fc], ["fc"])
        self.fc = nn.Linear(fc.fields["weight"].shape[0], fc.fields["weight"].shape[1], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.from_numpy(fc.fields["weight"].T.copy()))
        self.distance_threshold = next(walk).fields["distance_threshold"]

    @staticmethod
    def _expect(layers: list[Layer], kinds: list[str]) -> None:
        found = [layer.kind for layer in layers]
        if found != kinds:
            raise DlibFormatError(f"layers {found} where the network has {kinds}", layers[0].offset_bytes)

    def forward(self, chips: torch.Tensor) -> torch.Tensor:
        if chips.dim() != 4 or tuple(chips.shape[1:]) != (CHIP_SIZE_PX, CHIP_SIZE_PX, 3):
            raise ValueError(f"chips must be (N, {CHIP_SIZE_PX}, {CHIP_SIZE_PX}, 3) RGB, got {tuple(chips.shape)}")
        x = (chips.to(self.mean_rgb.dtype) - self.mean_rgb) / 256.0
        x = x.permute(0, 3, 1, 2)
        x = F.max_pool2d(F.relu(self.stem(x)), self.stem_pool[0], self.stem_pool[1])
        x = self.units(x)
        return self.fc(x.mean(dim=(2, 3)))


def load_dlib_face_resnet(path: str | os.PathLike) -> DlibFaceResNet:
    """Read dlib's ``dlib_face_recognition_resnet_model_v1.dat`` into a :class:`DlibFaceResNet`
    (on the CPU, eval mode). Raises :class:`EmbeddingModelInvalid` naming the file, the byte
    offset and what was wrong there (truncated, another network, corrupt numbers), and
    :class:`~facecast.models.assets.ModelMissing` when there is no file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise assets.ModelMissing(assets.FACE_EMBEDDING_FILE, path.parent, detail=(
            f"face embedding model not found at {path}; run `{assets.INSTALL_COMMAND}`"))
    data = path.read_bytes()
    try:
        model = DlibFaceResNet(read_network(data, anet_specs()))
    except (DlibFormatError, StopIteration) as error:
        what = error if isinstance(error, DlibFormatError) else "the network ends early"
        raise EmbeddingModelInvalid(f"{path} is not dlib's face recognition ResNet "
                                    f"({len(data)} bytes): {what}") from None
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Chips (Note [Chip points from the mesh], Note [Sampling dlib's chip])


def mesh_chip_points(landmarks_px: torch.Tensor) -> torch.Tensor:
    """(N, 478 or 468, 2+) mesh landmarks in frame pixels → (N, 5, 2): dlib's 5 points."""
    if landmarks_px.dim() != 3 or landmarks_px.shape[1] < 468 or landmarks_px.shape[2] < 2:
        raise ValueError(f"landmarks must be (N, 478, 2 or 3) mesh points, got {tuple(landmarks_px.shape)}")
    index = torch.tensor(MESH_CHIP_POINT_INDICES, device=landmarks_px.device)
    return landmarks_px[:, index, :2].float()


def chip_rects(points_px: torch.Tensor, size_px: int = CHIP_SIZE_PX,
               padding: float = CHIP_PADDING) -> tuple[RotatedRects, torch.Tensor]:
    """dlib's ``get_face_chip_details`` for N faces' 5 points (N, 5, 2) in frame pixels.

    Returns the rects for :func:`crop_rois` that sample dlib's chip pixels (Note [Sampling
    dlib's chip]) and each chip's shrink factor (frame pixels between neighbouring chip pixels).
    The similarity transform is the least-squares one (dlib's
    ``find_similarity_transform``, Umeyama's; in 2-D the linear fit of ``[[a, -b], [b, a]]``).
    """
    if points_px.dim() != 3 or tuple(points_px.shape[1:]) != (5, 2):
        raise ValueError(f"points must be (N, 5, 2), got {tuple(points_px.shape)}")
    points_px = points_px.to(torch.float64)  # the fit subtracts frame-sized coordinates
    template = torch.from_numpy((padding + _DLIB_CHIP_TEMPLATE) / (2 * padding + 1) * size_px).to(points_px)
    template_centre = template.mean(dim=0)
    chip = template - template_centre  # (5, 2)
    image_centre = points_px.mean(dim=1)  # (N, 2)
    image = points_px - image_centre[:, None, :]
    norm = (chip ** 2).sum()
    a = (chip[None, :, 0] * image[..., 0] + chip[None, :, 1] * image[..., 1]).sum(dim=1) / norm
    b = (chip[None, :, 0] * image[..., 1] - chip[None, :, 1] * image[..., 0]).sum(dim=1) / norm
    # image = A·chip_point + t, A = [[a, -b], [b, a]]
    translation = image_centre - torch.stack([a * template_centre[0] - b * template_centre[1],
                                              b * template_centre[0] + a * template_centre[1]], dim=1)
    scale = torch.hypot(a, b)
    angle = torch.atan2(b, a)
    half = size_px / 2.0
    centre = translation + torch.stack([a * half - b * half, b * half + a * half], dim=1)
    spacing = (scale * size_px - 1) / (size_px - 1)  # frame px between neighbouring chip pixels
    width = spacing * size_px  # crop_rois's rect: sample u at centre' + R·(u·w/S − w/2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    shift = spacing / 2  # centre' = c + R·(w/(2S), w/(2S))
    centre = centre + torch.stack([cos * shift - sin * shift, sin * shift + cos * shift], dim=1)
    rects = RotatedRects(centre.float(), torch.stack([width, width], dim=1).float(), angle.float())
    return rects, spacing.float()


def extract_chips(frames: FrameBatch, frame_index: torch.Tensor, points_px: torch.Tensor,
                  antialias_samples: int = ANTIALIAS_SAMPLES) -> torch.Tensor:
    """dlib's face chips of N faces: (N, 150, 150, 3) float32 RGB 0..255 on the frames' device.

    ``frame_index`` (N,): each face's frame in ``frames``; ``points_px`` (N, 5, 2): dlib's five
    points in that frame's pixels (:func:`mesh_chip_points`). ``antialias_samples`` K: K×K
    samples per chip pixel for shrunk faces (Note [Sampling dlib's chip]); 1 samples once, as
    dlib does without its pyramid. On a GPU nothing waits for the device and every face gets
    the K×K samples (for a face that is not shrunk they coincide: the same chip); on the CPU,
    where looking costs nothing, only shrunk faces do.
    """
    device = frames.device
    points_px = points_px.to(device)
    frame_index = frame_index.to(device=device, dtype=torch.long)
    rects, spacing = chip_rects(points_px)
    single = None
    if antialias_samples <= 1 or device.type == "cpu":
        single = crop_rois(frames, frame_index, rects, CHIP_SIZE_PX, border="zero", value_range=(0.0, 255.0))
        if antialias_samples <= 1:
            return single
    spread = ((spacing - ANTIALIAS_FROM_SHRINK) / (ANTIALIAS_FULL_AT_SHRINK - ANTIALIAS_FROM_SHRINK)).clamp(0.0, 1.0)
    if single is not None:
        shrunk = torch.nonzero(spread > 0).flatten()
        if len(shrunk) == 0:
            return single
        single[shrunk] = _supersampled(frames, frame_index[shrunk], rects[shrunk], spacing[shrunk],
                                       spread[shrunk], antialias_samples)
        return single
    return _supersampled(frames, frame_index, rects, spacing, spread, antialias_samples)


def _supersampled(frames: FrameBatch, frame_index: torch.Tensor, rects: RotatedRects, spacing: torch.Tensor,
                  spread: torch.Tensor, k: int) -> torch.Tensor:
    device = frames.device
    offsets = (torch.arange(k, dtype=torch.float32, device=device) + 0.5) / k - 0.5  # chip px
    cos, sin = torch.cos(rects.rotation_rad), torch.sin(rects.rotation_rad)
    total = None
    for offset_v in offsets:
        for offset_u in offsets:
            du = offset_u * spread * spacing  # frame px along the chip's axes
            dv = offset_v * spread * spacing
            moved = RotatedRects(rects.center_xy_px + torch.stack([cos * du - sin * dv, sin * du + cos * dv], dim=1),
                                 rects.size_wh_px, rects.rotation_rad)
            crop = crop_rois(frames, frame_index, moved, CHIP_SIZE_PX, border="zero", value_range=(0.0, 255.0))
            total = crop if total is None else total.add_(crop)
    return total.div_(k * k)


# ---------------------------------------------------------------------------------------------
# The component the participants code uses


class FaceEmbedder:
    """dlib's face descriptor for faces measured by facecast, batched, on one device.

    Stateless after construction (the weights); safe to call from one worker thread at a time.
    """

    def __init__(self, model_path: str | os.PathLike, device: torch.device | str = "cpu",
                 antialias_samples: int = ANTIALIAS_SAMPLES):
        self.device = torch.device(device)
        self.model_path = Path(model_path)
        self.network = load_dlib_face_resnet(model_path).to(self.device)
        self.antialias_samples = antialias_samples

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike | None = None, device: torch.device | str = "cpu",
                       **options) -> "FaceEmbedder":
        """The network ``facecast models install`` installed (SHA-256 checked; never downloads)."""
        return cls(assets.face_embedding_model_path(model_dir), device, **options)

    @torch.inference_mode()
    def embed_chips(self, chips: torch.Tensor | np.ndarray) -> torch.Tensor:
        """(N, 150, 150, 3) RGB chips, 0..255 → (N, 128) float32 on this embedder's device."""
        chips = torch.as_tensor(chips).to(self.device)
        if chips.shape[0] == 0:
            return torch.zeros(0, EMBEDDING_SIZE, device=self.device)
        return self.network(chips)

    @torch.inference_mode()
    def embed_landmarks(self, frames: FrameBatch, frame_index: torch.Tensor,
                        landmarks_px: torch.Tensor) -> torch.Tensor:
        """Embeddings of N faces from their mesh: ``landmarks_px`` (N, 478, 2 or 3) in the pixels
        of frame ``frame_index[i]`` of ``frames`` (on this embedder's device). → (N, 128)."""
        if landmarks_px.shape[0] == 0:
            return torch.zeros(0, EMBEDDING_SIZE, device=self.device)
        chips = extract_chips(frames, frame_index, mesh_chip_points(landmarks_px.to(frames.device)),
                              self.antialias_samples)
        return self.network(chips.to(self.device))
