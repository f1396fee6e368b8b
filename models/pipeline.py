"""FacePipeline: detection → rotated ROI → 478 landmarks → head pose → blendshapes and the facial
transformation matrix, batched over frames and faces, with landmark-driven tracking per camera
(DESIGN §3).

FacePipeline loads the models and composes the stages, each in its own module and each batched
over every frame (and face) of a call:

1. **Detection** (:mod:`facecast.models.face_detection`): MediaPipe's short-range detector on each
   whole frame (letterboxed), and the full-range detector on each whole frame at a finer scale
   (small faces), merged.
2. **ROI** (:mod:`facecast.models.roi`): square, 1.5x the box, rotated by the eye line.
3. **Measuring** (:mod:`facecast.models.face_mesh`): every ROI of every frame warped in one
   gather from the frames' uint8 pixels to the landmark model's input. With
   ``face_landmarker.task`` it is MediaPipe FaceLandmarker's stack, model for model: its v2
   landmarker (256x256), its blendshape model, its facial transformation matrix (head rotation
   and translation in cm); without it, the attention mesh (192x192) and head pose from the
   landmarks. Detection (with the full-range detector for small faces, which MediaPipe lacks) is
   the same.
4. **Tracking** (:mod:`facecast.models.face_tracking`): per camera, the next frame's ROIs come
   from this frame's landmarks (MediaPipe's face_landmarks_to_roi); the detector runs only when a
   camera has no face, lost one, or every ``detect_interval_frames`` frames to pick up newcomers
   where its tracks leave room for one.

No stage loops over frames or faces in Python or waits for the device before its end
(Note [Detection without per-frame work]); with
``cuda_graphs=True`` detection and the mesh stage are replayed from CUDA graphs (Note [CUDA
graphs of the pipeline]), with ``half=True`` the models
run in float16. ``bench/models.py`` measures these paths.

Outputs are in the pixels of each input frame; landmark z is on the scale of x (pixels), negative
toward the camera, relative to the face's centre of mass as in MediaPipe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

import torch

from facecast.models import anchors as anchors_mod
from facecast.models import roi as roi_mod
from facecast.models import tflite_convert, tflite_ops
from facecast.models import triton_kernels
from facecast.models.cuda_graphs import GraphCache
from facecast.models.face_detection import WHOLE_FRAME_INPUT_HW, FaceDetector
from facecast.models.face_mesh import Face, FaceMeasurer, PendingMeasure
from facecast.models.face_tracking import FaceTracks
from facecast.models.litert_models import LiteRTModel, LiteRTUnavailable

if TYPE_CHECKING:
    from facecast.models import assets

log = logging.getLogger(__name__)

ModelLoader = Callable[[str], torch.nn.Module]

# How FacePipeline runs its models on the CPU (Note [LiteRT on the CPU]).
CPU_RUNTIMES = ("litert", "torch")


def _default_loader(name: str) -> torch.nn.Module:
    """Load a MediaPipe model as a torch module (the installer/converter of facecast.models)."""
    from facecast.models import assets

    return tflite_convert.convert(assets.model_path(name))


def bundle_name(task) -> str:
    """A face_landmarker.task given as a path or as an unpacked bundle, for a message."""
    return str(getattr(task, "task_path", task))


@dataclass
class PendingTrack:
    """A :meth:`FacePipeline.track_start` on its way (for :meth:`FacePipeline.track_finish`)."""

    states: list
    owners: list[int]
    measuring: PendingMeasure


# Note [Compiled models]
#     With compile_models=True the measuring stage's models (the landmark model, the blendshape
#     model) run inductor's code (torch.compile, dynamic batch: one compilation serves every
#     bucket but the batch of 1), inside the stage's CUDA graph as before. Under compilation a
#     convolution is the plain F.conv2d with its bias and activation (Note [Convolutions on
#     the GPU]'s fused cuDNN call has no kernel for the tracer's fake tensors), which inductor
#     fuses with the elementwise operators around it. Measured on an H100 (bench/models.py,
#     batch 64, 2026-11-26, one run): the attention-mesh stack 8,415 -> 11,238 faces/s (fp16 +
#     graphs, results on the host), the FaceLandmarker stack 8,103 -> 10,486 (fp16) and 10,783
#     (fp32 compiled), with the same parity against fp32 eager (landmark median 0.028 % of the
#     face width in fp16, 0.005 % in fp32; blendshapes within 0.014). The detectors compiled
#     were slower (32 1080p frames 6.15 -> 6.99 ms in fp16), so they are not. The price is the
#     compilation at warm-up, in every process: the FaceLandmarker buckets up to 64 faces took
#     33-57 s with an empty inductor cache and 22-27 s with a warm one (dynamo traces again in
#     each process) where the daemon's READY at 64 cameras comes after 22.5 s in all, so the
#     daemon does not compile; models compiled ahead of time once per machine (AOTInductor)
#     would drop that price.


# Note [Threads of the models] (facecast.daemon.cli.analyze): XNNPACK's threads pay only where an
# invoke is milliseconds of work. The models of a fraction of a millisecond run on one thread,
# slower on two (2-core machine, 2026-11-27, best of 3 x 200 invokes): the blendshape model 0.38
# ms against 0.33 on one, the short-range detector 0.62 against 0.64; the landmark model 2.40
# against 3.26 and the full-range detector over a whole frame (512x288) 5.39 against 8.34.
ONE_THREAD_MODELS = frozenset({anchors_mod.FACE_SHORT_RANGE.name, "face_blendshapes"})


class FacePipeline:
    """Faces of a batch of frames.

    ``pipeline(frames)`` detects in every frame (stateless); ``pipeline.track(frames,
    camera_ids)`` keeps per-camera tracks and detects only when needed. ``frames`` is a list of
    HxWx3 uint8 BGR numpy arrays (sizes may differ) or a uint8 tensor (B, H, W, 3), BGR, on any
    device (it is moved to ``device``).

    Speed options (both off by default; results agree with the float32 eager path within the
    tolerances of tests/models/test_speed_paths.py):

    - ``half=True`` runs the models in float16 (crop sampling, geometry, decoding, NMS and head
      pose stay in float32/float64); CUDA devices only.
    - ``cuda_graphs=True`` replays detection and the mesh stage as CUDA graphs (Note [CUDA graphs
      of the pipeline]); CUDA devices only. ``graph_fallbacks`` names the stages that could not
      be captured, and why.
    - ``compile_models=True`` compiles the landmark and blendshape models with inductor (Note
      [Compiled models]): about a third more faces a second at batch 64, for half a minute
      or more of compiling at warm-up; CUDA devices only, and not used by the daemon.

    ``cpu_runtime``: on the CPU, ``"litert"`` (the default) runs the FaceLandmarker models and
    both face detectors in LiteRT (XNNPACK) where ai-edge-litert is installed and they load in
    it, ``"torch"`` runs every model as a converted torch module (Note [LiteRT on the CPU]);
    ``model_runtimes`` says where each model runs, ``cpu_runtime_problem`` why one that could run
    in LiteRT does not. On a GPU every model is a converted torch module. ``cpu_threads``: the
    threads of the landmark model's and the full-range detector's invokes in LiteRT (default:
    as many as torch has; `facecast analyze` gives them the cores its torch thread leaves: Note
    [Threads of the models]); the small models run on one (ONE_THREAD_MODELS).

    ``full_range=False`` leaves out the full-range detector (MediaPipe's own detection: the
    short-range detector alone, faces from about a tenth of the frame's width).

    The stages: ``detector`` (:class:`~facecast.models.face_detection.FaceDetector`),
    ``measurer`` (:class:`~facecast.models.face_mesh.FaceMeasurer`), ``tracks``
    (:class:`~facecast.models.face_tracking.FaceTracks`), sharing ``graphs``.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        max_faces: int = 4,
        *,
        full_range: bool = True,
        min_presence: float = 0.5,
        detect_interval_frames: int = 15,
        face_landmarker_task: str | Path | assets.LandmarkerBundle | None = None,
        frames_are_bgr: bool = True,
        load_model: ModelLoader = _default_loader,
        half: bool = False,
        cuda_graphs: bool = False,
        compile_models: bool = False,
        cpu_runtime: str = "litert",
        cpu_threads: int | None = None,
    ):
        self.device = torch.device(device)
        if cpu_runtime not in CPU_RUNTIMES:
            raise ValueError(f"cpu_runtime must be one of {', '.join(CPU_RUNTIMES)}, got {cpu_runtime!r}")
        self.cpu_runtime = cpu_runtime
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {cpu_threads}")
        self.cpu_threads = cpu_threads
        # The CPU's own stack (LiteRT's models, LAPACK's rotations) rather than the GPU's code
        # run on the CPU.
        self.cpu_stack = self.device.type == "cpu" and cpu_runtime == "litert"
        self.model_runtimes: dict[str, str] = {}
        self.cpu_runtime_problem: str | None = None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("FacePipeline(device='cuda'): torch sees no CUDA device; use device='cpu'")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, not {self.device}")
        if compile_models and self.device.type != "cuda":
            raise ValueError(f"compile_models=True is for CUDA devices, not {self.device} (Note [Compiled models])")
        if half and self.device.type != "cuda":
            # Seen with torch 2.13's CPU kernels: float16 is several times slower than float32,
            # and grid_sample (the attention mesh's TransformTensorBilinear) sometimes returns NaN.
            raise ValueError(f"half=True is for CUDA devices, not {self.device}: the CPU's float16 kernels are "
                             "slower than float32 and not reliable")
        if max_faces < 1:
            raise ValueError(f"max_faces must be at least 1, got {max_faces}")
        self.frames_are_bgr = frames_are_bgr
        self.half = half
        self.model_dtype = torch.float16 if half else torch.float32

        short_range = self._prepare(load_model(anchors_mod.FACE_SHORT_RANGE.name), litert=True)
        full_range_model = (self._prepare(load_model(anchors_mod.FACE_FULL_RANGE.name), litert=True,
                                          image_sizes_hw=(WHOLE_FRAME_INPUT_HW, WHOLE_FRAME_INPUT_HW[::-1]))
                            if full_range else None)
        landmarker = None
        self.blendshapes_unavailable_reason = "no face_landmarker.task given"
        if face_landmarker_task is not None:
            landmarker = self._load_landmarker(face_landmarker_task)
        if landmarker is not None:
            mesh, blendshapes, geometry = landmarker
            self.landmarker = "face_landmarker"
        else:
            mesh, blendshapes, geometry = self._prepare(load_model("face_landmark_with_attention")), None, None
            self.landmarker = "attention_mesh"
        self.graphs = GraphCache(self.device, cuda_graphs)
        self.detector = FaceDetector(short_range, full_range_model, device=self.device,
                                     model_dtype=self.model_dtype, max_faces=max_faces, graphs=self.graphs)
        self.measurer = FaceMeasurer(mesh, blendshapes, device=self.device, model_dtype=self.model_dtype,
                                     max_faces=max_faces, min_presence=min_presence, graphs=self.graphs,
                                     landmarker=self.landmarker, geometry=geometry)
        self.tracks = FaceTracks(self.device, max_faces, detect_interval_frames)
        if compile_models:
            self._compile_models()

    @property
    def max_faces(self) -> int:
        """Faces kept per frame (fixed at construction: every stage holds it)."""
        return self.tracks.max_faces

    @property
    def cuda_graphs(self) -> bool:
        return self.graphs.enabled

    @property
    def graph_fallbacks(self) -> dict[str, str]:
        """Stage → why it runs eagerly although ``cuda_graphs`` is on."""
        return self.graphs.fallbacks

    @property
    def detect_interval_frames(self) -> int:
        """A tracked camera's frames between detection passes (for newcomers)."""
        return self.tracks.detect_interval_frames

    @detect_interval_frames.setter
    def detect_interval_frames(self, frames: int) -> None:
        self.tracks.detect_interval_frames = frames

    def _prepare(self, module: torch.nn.Module, litert: bool = False,
                 image_sizes_hw: Sequence[tuple[int, int]] = ()) -> torch.nn.Module:
        """A loaded model, ready to run here. On the CPU, one that LiteRT can run (``litert``,
        at its own input size and at ``image_sizes_hw``: Note [LiteRT on the CPU]) in LiteRT
        where ``cpu_runtime`` says so and it loads there. Otherwise the converted model: zero
        PADs folded into their convolutions, layer norms' operator chains into one step each, each
        residual ADD with the PRELU that reads it into one (and a halving block's shortcut, its
        max pool and channel PAD, into that one too), depthwise
        biases into the 1x1 convolutions that read them (float32), on the
        device, in the model dtype, eval mode; on CUDA with channels_last convolution weights (the
        activations already are: Note [Batch and layout]), which spares
        cuDNN a weight reorder per call; on the CPU each convolution with the kernel of Note
        [Convolutions on the CPU] (oneDNN with weights packed once, F.linear, or F.conv2d)."""
        name = getattr(module, "name", type(module).__name__)
        if litert and self.cpu_stack:
            in_litert = self._in_litert(module, image_sizes_hw)
            if in_litert is not None:
                self.model_runtimes[name] = "litert"
                return in_litert
        self.model_runtimes[name] = "torch"
        if isinstance(module, tflite_convert.TFLiteModule):
            tflite_convert.fuse_zero_padding(module)
            tflite_convert.fuse_layer_norms(module)  # Note [Layer norms in one kernel]
            tflite_convert.fuse_residual_prelus(module)  # Note [PReLUs in one kernel]
            tflite_convert.fuse_pooled_residuals(module)  # Note [Residual shortcuts in one kernel]
            if not self.half:  # Note [Convolutions on the GPU]: float32 only
                tflite_convert.fold_depthwise_bias(module)
        module = module.to(self.device, dtype=self.model_dtype).eval()
        if self.device.type == "cuda":
            for conv in module.modules():
                if isinstance(conv, tflite_ops.Conv2d):
                    conv.weight = conv.weight.contiguous(memory_format=torch.channels_last)
        elif self.device.type == "cpu":
            tflite_convert.use_cpu_kernels(module)
        return module

    def _in_litert(self, module: torch.nn.Module, image_sizes_hw: Sequence[tuple[int, int]]
                   ) -> LiteRTModel | None:
        """The converted model's file in a LiteRT interpreter on ``cpu_threads`` (default: torch's
        CPU threads; one for ONE_THREAD_MODELS), or None (the reason kept in
        ``cpu_runtime_problem`` and logged) where it cannot run there."""
        source = getattr(module, "source", None)
        if source is None:  # a model made some other way than from its file (a test's loader)
            return None
        try:
            threads = 1 if module.name in ONE_THREAD_MODELS else self.cpu_threads or torch.get_num_threads()
            return LiteRTModel(source, module.name, threads=threads, image_sizes_hw=image_sizes_hw)
        except LiteRTUnavailable as exc:
            if self.cpu_runtime_problem is None:
                log.warning("on the CPU the models run as converted torch modules: %s", exc)
            self.cpu_runtime_problem = str(exc)
            return None

    def _compile_models(self) -> None:
        """The landmark and blendshape models compiled by inductor (Note [Compiled models]);
        the compilation happens at each model's first call."""
        # Every converted model runs TFLiteModule.forward: dynamo keeps its compiled code per
        # code object, an entry per model and input kind, and a process may hold several
        # pipelines (bench/models.py builds one per variant).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

        def compiled(module):
            return torch.compile(module, dynamic=True, fullgraph=True)

        self.measurer.mesh = compiled(self.measurer.mesh)
        if self.measurer.blendshapes is not None:
            self.measurer.blendshapes = compiled(self.measurer.blendshapes)

    def _load_landmarker(self, task):
        """face_landmarker.task's v2 landmarker, blendshape model and face geometry, or None
        with a one-line reason (the attention mesh is then used). `task`: the bundle's path, or
        a bundle a worker already checked and unpacked (Note [Model files checked at load])."""
        from facecast.models import assets
        from facecast.models.face_geometry import FaceGeometry

        try:
            bundle = (task if isinstance(task, assets.LandmarkerBundle)
                      else assets.blendshape_model(Path(task)))
            landmarks = self._prepare(tflite_convert.convert(bundle.face_landmarks_detector), litert=True)
            # float32 even with half=True: Note [Blendshapes in float32].
            blendshapes = self._prepare(tflite_convert.convert(bundle.face_blendshapes), litert=True).float()
            # The CPU stack's rotations by LAPACK; the squarings where a graph may capture them
            # (Note [Procrustes without a solver]).
            geometry = FaceGeometry.read(bundle.geometry_metadata,
                                         procrustes_method="eigh" if self.cpu_stack else "squaring")
        except (assets.ModelError, OSError, ValueError) as error:
            self.blendshapes_unavailable_reason = f"blendshapes unavailable: {error}"
            log.warning("%s", self.blendshapes_unavailable_reason)
            return None
        except Exception as error:  # noqa: BLE001 - a user's bundle has no pinned sum: bytes that
            # do not convert fail anywhere in the flatbuffer reader (issue 21); say what failed.
            self.blendshapes_unavailable_reason = (
                f"blendshapes unavailable: {bundle_name(task)} does not convert "
                f"({type(error).__name__}: {error})")
            log.warning("%s", self.blendshapes_unavailable_reason)
            return None
        self.blendshapes_unavailable_reason = None
        return landmarks, blendshapes, geometry

    def _batch(self, frames) -> roi_mod.FrameBatch:
        """The frames as a FrameBatch: one given (:meth:`batch_in_place`) is used as it is, a list
        is stacked into one."""
        if isinstance(frames, roi_mod.FrameBatch):
            return frames
        return roi_mod.FrameBatch(frames, self.device, bgr=self.frames_are_bgr)

    # -- public API ------------------------------------------------------------------------------

    def release_graphs(self) -> bool:
        """Drop the CUDA graphs and their memory pool, keeping the models and what the GPU
        libraries prepared for each shape, so that :meth:`warm_up` captures them again quickly
        (a warm spare's: Note [Spares without graphs]). Returns whether there were graphs."""
        return self.graphs.release()

    def batch_in_place(self, frames: Sequence[torch.Tensor]) -> roi_mod.FrameBatch:
        """Frames read from the rings as one batch, for :meth:`track_start`, :meth:`track` and
        :meth:`detect` to use where they lie (FrameBatch.in_place: no stacked copy). Nothing may
        write them while the work on them is queued."""
        return roi_mod.FrameBatch.in_place(frames, self.device, bgr=self.frames_are_bgr)

    @torch.inference_mode()
    def __call__(self, frames) -> list[list[Face]]:
        batch = self._batch(frames)
        detections = self.detect(batch)
        owners = [i for i, (boxes, _, _) in enumerate(detections) for _ in range(boxes.shape[0])]
        if not owners:
            return [[] for _ in detections]
        # The detections (on the host) back to the device in one copy.
        table = roi_mod.from_host(torch.cat([torch.cat([boxes, keypoints.flatten(1), scores[:, None]], dim=1)
                                             for boxes, keypoints, scores in detections]), self.device)
        boxes, keypoints, scores = table[:, :4], table[:, 4:-1].reshape(len(owners), -1, 2), table[:, -1]
        rects = roi_mod.rects_from_detections(boxes, keypoints)
        return self.measurer.measure(batch, owners, rects, boxes, scores, [False] * len(owners)).faces

    @torch.inference_mode()
    def track(self, frames, camera_ids: Sequence[Hashable], detections=None) -> list[list[Face]]:
        """Like calling the pipeline, but with per-camera tracking state (one frame per camera
        per call, in ``camera_ids`` order).

        ``frames``: the frames (HxWx3 uint8 arrays or tensors), or a batch of them from
        :meth:`batch_in_place`.
        ``detections``: None to run the detector here whenever a camera needs it; or, when
        detection runs elsewhere (the daemon's detection worker), a dict from frame index to
        that frame's (boxes, keypoints, scores) as :meth:`detect` returns them, used to add
        new faces to the tracks (:meth:`wants_detection` says which cameras should get one).
        """
        return self.track_finish(self.track_start(frames, camera_ids, detections))

    @torch.inference_mode()
    def track_start(self, frames, camera_ids: Sequence[Hashable], detections=None) -> PendingTrack:
        """:meth:`track`'s device work, queued: nothing waits for the device until
        :meth:`track_finish`, which must come before the next track_start (the next ROIs come
        from these landmarks). Meanwhile the caller may read its next frames (Note [Reading
        while the device measures])."""
        batch = self._batch(frames)
        if len(camera_ids) != len(batch):
            raise ValueError(f"{len(batch)} frames but {len(camera_ids)} camera ids")
        states = self.tracks.states(camera_ids)
        if detections is None:
            detect_frames = [i for i, cam in enumerate(camera_ids) if self.wants_detection(cam)]
            det_by_frame = dict(zip(detect_frames, self.detect(batch, detect_frames) if detect_frames else []))
        else:
            det_by_frame = dict(detections)
        rois = self.tracks.next_rois(states, det_by_frame)
        measuring = self.measurer.measure_start(batch, rois.owners, rois.rects, rois.boxes_px,
                                                rois.scores, rois.tracked)
        return PendingTrack(states, rois.owners, measuring)

    @torch.inference_mode()
    def track_finish(self, pending: PendingTrack) -> list[list[Face]]:
        """The faces of a :meth:`track_start`, each camera's tracks moved on by them."""
        measured = self.measurer.measure_finish(pending.measuring)
        self.tracks.follow(pending.states, pending.owners, measured)
        return measured.faces

    def wants_detection(self, camera_id: Hashable) -> bool:
        """Whether the camera's next frame should get a detection pass: it has no face, lost
        one, or it is time to look for newcomers and one could be followed."""
        return self.tracks.wants_detection(camera_id)

    def has_room(self, camera_id: Hashable) -> bool:
        """Whether a newcomer found on the camera's next frame would be followed (Note [No
        search where no face could go], models/face_tracking.py)."""
        return self.tracks.has_room(camera_id)

    def reset(self, camera_id: Hashable | None = None) -> None:
        """Forget the tracks of one camera (or of all)."""
        self.tracks.reset(camera_id)

    @torch.inference_mode()
    def detect(self, batch: roi_mod.FrameBatch, frame_indices: Sequence[int] | None = None):
        """Faces of the given frames (all by default): per frame, (boxes (M, 4) px,
        keypoints (M, 6, 2) px, scores (M,)), on the host (one copy for all frames), best
        first, at most ``max_faces`` (at most twice that with ``full_range=False``, as NMS leaves
        them)."""
        return self.detector.detect(batch, frame_indices)

    @torch.inference_mode()
    def warm_up(self, frame_sizes_hw: Sequence[tuple[int, int]], max_frames: int = 0,
                max_faces: int = 0) -> None:
        """On a GPU, run once every batch bucket of the models that detection over up to
        ``max_frames`` frames and the mesh over up to ``max_faces`` faces can meet, and with
        ``cuda_graphs`` capture their graphs for frames of each size (Note [Warm shapes]). Nothing to do on the CPU."""
        if self.device.type == "cuda":  # compiled before any batch needs them (Note [Kernels of our own])
            triton_kernels.prepare(self.device, [(self.detector.model_dtype, "zero"),
                                              (self.measurer.model_dtype, "replicate")])
        self.detector.warm_up(frame_sizes_hw, max_frames)
        self.measurer.warm_up(max_faces)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
