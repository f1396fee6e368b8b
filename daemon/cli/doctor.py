"""`facecast doctor`: check this machine and say what facecast will use here, and why.

Runs on the CLI side, in a process of its own. It checks against a config: `--config FILE`,
else the running daemon's (asked for its config file over the control socket, as `facecast
status` asks; `--runtime-dir` finds a daemon elsewhere), else the built-in defaults. It answers,
on one screen: is there a GPU and which (PyTorch, NVML), does CUDA IPC pass validation between
two fresh processes or what will `transport = "auto"` use instead, can NVDEC decode the cameras'
H.264/H.265 (and with how many engines) or why not, does LSL work on this machine's loopback,
are the models installed, and what runs them without a GPU.

Note [Doctor's time]
    On the 2-core CI machine (busy) doctor took 12.5 s; 5.4-7.4 s of it (2026-11-26, load 5-8)
    were the CUDA IPC proof: a fresh process that imports torch, then 60 frames at 30 fps and
    its settling (~3.3 s of waiting), the rest mostly torch imported by doctor itself for the
    GPU check. Where this process sees no CUDA device (or no PyCUDA) the proof can only show
    shm, which every machine has and CI proves: doctor says why it was not tried instead
    (`facecast transport-check --transport shm` still runs it). Running the proof on a thread
    beside the GPU check was tried and gained nothing on 2 cores: two torch imports at once
    take as long as one after the other.

Each check is a small function returning a `CheckResult` (name, state, detail) so that tests can
run them one by one. States: `ok`; `warn` (facecast runs, but not the best way: no GPU, shm
instead of CUDA IPC, no blendshapes); `FAIL` (facecast cannot run here as configured). The exit
code is 1 when any check FAILs, else 0: LSL and the models are required, the GPU is optional.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from facecast.shared import config

log = logging.getLogger(__name__)

OK = "ok"
WARN = "warn"
FAIL = "FAIL"

LSL_TIMEOUT_S = 5.0
LSL_LOOPBACK_SAMPLES = 5
# Not "facecast-": `facecast streams` lists only the daemon's streams, and the doctor's short-lived
# loopback stream must not appear there when both run at once.
LSL_LOOPBACK_SOURCE_PREFIX = "fcdoctor-"



@dataclass(frozen=True)
class CheckResult:
    """One line of the doctor's screen, plus optional indented facts under it."""

    name: str
    state: str  # OK, WARN or FAIL
    detail: str
    lines: tuple[str, ...] = ()


# --- GPU -----------------------------------------------------------------------------------------


def check_gpu(models_device: str = "auto") -> CheckResult:
    """CUDA devices PyTorch can see, and where the models will therefore run."""
    import torch

    build = f"torch {torch.__version__}" + (
        f" with CUDA {torch.version.cuda}" if torch.version.cuda else "")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        build += f", CUDA_VISIBLE_DEVICES={visible!r}"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"{build} is a CPU-only build"
        else:
            why = f"{build}: no NVIDIA GPU, no driver, or CUDA_VISIBLE_DEVICES hides them"
        if models_device == "cuda":
            return CheckResult("GPU", FAIL, f"no CUDA device visible to PyTorch ({why}), but the "
                               'config sets models.device = "cuda"')
        return CheckResult("GPU", WARN, f"no CUDA device visible to PyTorch ({why}); models run "
                           "on the CPU")
    lines = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        lines.append(f"cuda:{index}  {properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
                     f"compute capability {properties.major}.{properties.minor}")
    where = "the CPU (models.device = \"cpu\")" if models_device == "cpu" else "cuda"
    return CheckResult("GPU", OK, f"{len(lines)} CUDA device(s) visible to PyTorch ({build}); "
                       f"models run on {where}", tuple(lines))


def check_nvml() -> CheckResult:
    """NVIDIA driver version, and each GPU's memory and utilisation, through NVML."""
    try:
        import pynvml
    except ImportError as exc:
        return CheckResult("NVML", WARN, f"pynvml cannot be imported ({exc}); install nvidia-ml-py "
                           "for GPU memory and utilisation in doctor and status")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        # The usual case on a machine without the NVIDIA driver: libnvidia-ml.so is absent.
        why = ("no NVIDIA driver here" if isinstance(exc, pynvml.NVMLError_LibraryNotFound)
               else "the driver refused")
        return CheckResult("NVML", WARN, f"NVML unavailable ({exc}): {why}, so no driver version "
                           "or GPU memory/utilisation to report")
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        count = pynvml.nvmlDeviceGetCount()
        lines = [_nvml_device_line(pynvml, index) for index in range(count)]
    except pynvml.NVMLError as exc:
        return CheckResult("NVML", WARN, f"NVML initialised but a query failed: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)
    return CheckResult("NVML", OK, f"NVIDIA driver {driver}, {count} GPU(s)", tuple(lines))


def _nvml_device_line(pynvml, index: int) -> str:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(pynvml.nvmlDeviceGetName(handle))
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    memory_text = f"{memory.used / 2**30:.1f} of {memory.total / 2**30:.1f} GiB used"
    try:
        utilization_text = f"{pynvml.nvmlDeviceGetUtilizationRates(handle).gpu}% busy"
    except pynvml.NVMLError as exc:  # e.g. NotSupported on some virtualised GPUs
        utilization_text = f"utilisation n/a ({exc})"
    return f"nvml:{index}  {name}, {memory_text}, {utilization_text}"


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


# --- frame transport -----------------------------------------------------------------------------


def check_transport(loaded: config.Config | None = None) -> CheckResult:
    """What `transport = "auto"` (and each configured camera) will use here, and why.

    A pure decision (`choose_transport`) on what this process can see; whether CUDA IPC then
    passes validation between processes is `check_cuda_ipc`'s question.
    """
    from facecast.shared.transport.cuda_driver import cuda_unavailable_reason
    from facecast.shared.transport.publisher import choose_transport

    reason = cuda_unavailable_reason()
    chosen, _ = choose_transport("auto", reason)
    lines = []
    if loaded is not None:
        for camera in loaded.cameras:
            requested = loaded.transport_for(camera)
            camera_chosen, _ = choose_transport(requested, reason)
            lines.append(f"camera {camera.id}: transport = {requested!r} -> {camera_chosen}")
    if chosen == "cuda_ipc":
        return CheckResult("transport", OK, 'auto tries cuda_ipc (each camera falls back to shm, '
                           "with the reason, if a consumer cannot validate it)", tuple(lines))
    return CheckResult("transport", WARN, f"auto uses shm because {reason}", tuple(lines))


def check_cuda_ipc(run_check: Callable[[str], dict] | None = None) -> CheckResult:
    """Send frames from this process to a freshly spawned one with `transport = "auto"`.

    `run_check` defaults to `transport_check.check` (the same proof as `facecast
    transport-check`); tests pass a stand-in to exercise the verdicts.
    """
    if run_check is None:
        from facecast.daemon.cli import transport_check

        run_check = transport_check.check
    started_monotonic = time.monotonic()
    try:
        report = run_check("auto")
    except Exception as exc:  # any failure to even run the proof is a line on the screen
        log.debug("transport check raised", exc_info=True)
        return CheckResult("CUDA IPC", FAIL, f"the frame transport check could not run: "
                           f"{type(exc).__name__}: {exc}")
    took_s = time.monotonic() - started_monotonic
    verified = int(report.get("verified", 0))
    wrong = int(report.get("wrong", 0))
    transport = report.get("transport") or report.get("producer_transport") or "?"
    frames = (f"{verified} frames verified byte for byte on {transport}, {wrong} wrong "
              f"({took_s:.1f} s)")
    if "error" in report:
        return CheckResult("CUDA IPC", FAIL, f"frame transport check failed: {report['error']}")
    if wrong or not verified:
        return CheckResult("CUDA IPC", FAIL,
                           f"frames between two processes are not intact: {frames}")
    if transport == "cuda_ipc":
        return CheckResult("CUDA IPC", OK,
                           f"passes validation between two fresh processes: {frames}")
    reason = report.get("reason") or report.get("producer_reason") or "no reason given"
    return CheckResult("CUDA IPC", WARN, f"not used: {reason}; frames fall back to shm: {frames}")


# --- GPU decoding --------------------------------------------------------------------------------


def check_nvdec(loaded: config.Config | None = None,
                decoder_caps: Callable[[str], dict] | None = None) -> CheckResult:
    """Whether NVDEC can decode H.264/H.265 here and with how many engines, and what each
    configured camera's `decode` leads to (Note [Decoder choice]). A camera's codec is known
    only once its source opens: where the GPU would be tried, the line says so."""
    from facecast.shared.camera_sources import SourceConfigError, source_kind
    from facecast.workers.capture import decoding

    reason = decoding.nvdec_unavailable_reason()
    jpeg_reason = decoding.nvjpeg_unavailable_reason()  # MJPEG cameras (Note [nvJPEG path])
    lines = [f"nvJPEG (MJPEG cameras): unavailable: {jpeg_reason}" if jpeg_reason else
             "nvJPEG (MJPEG cameras): available (nvidia-nvimgcodec-cu13)"]
    if loaded is not None:
        import torch

        on_gpu = loaded.models.device != "cpu" and torch.cuda.is_available()
        for camera in loaded.cameras:
            try:
                kind = source_kind(camera.source)
            except SourceConfigError:
                continue  # check-config and the transport check say what is wrong with it
            device = f"cuda:{max(camera.gpu, 0)}" if on_gpu else "cpu"
            request = decoding.DecodeRequest(loaded.decode_for(camera), device)
            choice = decoding.plan(request, kind, nvdec_reason=lambda: reason,
                                   nvjpeg_reason=lambda: jpeg_reason)
            told = (f"{choice.decoder}: {choice.reason}" if choice is not None else
                    "gpu where its video is H.264/H.265, 8-bit 4:2:0, or MJPEG (known when it "
                    "opens), else cpu, with the reason in status")
            lines.append(f"camera {camera.id}: {request.asked()} -> {told}")
    if reason:
        return CheckResult("NVDEC", WARN, f"GPU decoding unavailable: {reason}; H.264/H.265 "
                           "cameras are decoded on the CPU", tuple(lines))
    if decoder_caps is None:
        decoder_caps = _nvdec_caps
    engines = []
    for codec, name in decoding.GPU_CODECS.items():
        try:
            caps = decoder_caps(codec)
        except Exception as exc:  # noqa: BLE001 - one line on the screen, not a traceback
            engines.append(f"{name}: capabilities unknown ({type(exc).__name__}: {exc})")
            continue
        if not caps.get("supported"):
            engines.append(f"{name}: not supported by this GPU")
        else:
            engines.append(f"{name}: {caps.get('num_decoder_engines', '?')} NVDEC engine(s), up "
                           f"to {caps.get('width_max', '?')}x{caps.get('height_max', '?')}")
    return CheckResult("NVDEC", OK, "GPU decoding available (pynvvideocodec); " +
                       "; ".join(engines), tuple(lines))


def _nvdec_caps(codec: str) -> dict:
    """PyNvVideoCodec's GetDecoderCaps for 8-bit 4:2:0 of `codec` (it makes a context of its own
    on GPU 0 for the query, in this process: doctor's, never a worker's)."""
    import PyNvVideoCodec as nvc

    return dict(nvc.GetDecoderCaps(
        gpuid=0, codec=getattr(nvc.cudaVideoCodec, {"h264": "H264", "hevc": "HEVC"}[codec]),
        chromaformat=getattr(nvc.cudaVideoChromaFormat, "420"), bitdepth=8))


# --- LSL -----------------------------------------------------------------------------------------


def lsl_config_in_effect() -> tuple[str, str | None]:
    """(which lsl_api.cfg liblsl reads in this process, a problem with $LSLAPICFG or None).

    liblsl reads its configuration once per process, at first use: this describes what a fresh
    facecast process (doctor, or the daemon started with the same environment) will read. The
    copy that facecast makes to quiet liblsl (Note [liblsl's log level]) is named with what it
    copies.
    """
    from facecast.shared.third_party_logs import generated_from, lsl_config_file

    path, problem = lsl_config_file()
    if path is None:
        return ("none: liblsl's defaults ($LSLAPICFG unset or unusable, and no lsl_api.cfg in ./, "
                "~/lsl_api/ or /etc/lsl_api/)"), problem
    origin = generated_from(path)
    if origin is not None:
        return f"{path} ({origin})", problem
    if os.environ.get("LSLAPICFG") and Path(os.environ["LSLAPICFG"]) == path:
        return f"{path} (from $LSLAPICFG)", problem
    return f"{path} (no usable $LSLAPICFG; found on liblsl's search path)", problem


def check_lsl_loopback(timeout_s: float = LSL_TIMEOUT_S,
                       sample_count: int = LSL_LOOPBACK_SAMPLES) -> CheckResult:
    """Publish a stream, resolve it by source_id, and read samples back through an inlet."""
    config_text, config_problem = lsl_config_in_effect()
    lines = (f"LSL config: {config_text}",) + ((config_problem,) if config_problem else ())
    try:
        import pylsl
    except (ImportError, RuntimeError) as exc:  # pylsl raises RuntimeError when liblsl is missing
        return CheckResult("LSL loopback", FAIL, f"pylsl cannot load liblsl: {exc}", lines)

    started_monotonic = time.monotonic()
    deadline_monotonic = started_monotonic + timeout_s
    source_id = f"{LSL_LOOPBACK_SOURCE_PREFIX}{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
    sent = [[1000.0 + index] for index in range(sample_count)]
    outlet = inlet = None
    try:
        info = pylsl.StreamInfo("facecast doctor loopback", "FacecastDoctor", 1,
                                pylsl.IRREGULAR_RATE, pylsl.cf_double64, source_id)
        outlet = pylsl.StreamOutlet(info)
        found = pylsl.resolve_byprop("source_id", source_id, minimum=1, timeout=timeout_s)
        if not found:
            return CheckResult("LSL loopback", FAIL, (
                f"this machine's own stream was not resolved within {timeout_s:g} s (multicast "
                "blocked, or an lsl_api.cfg whose KnownPeers/ResolveScope excludes this machine?)"),
                lines)
        inlet = pylsl.StreamInlet(found[0], max_buflen=10, processing_flags=pylsl.proc_none)
        inlet.open_stream(timeout=max(0.1, deadline_monotonic - time.monotonic()))
        for sample in sent:  # pushed after the inlet is connected: a new inlet gets no backlog
            outlet.push_sample(sample)
        received = []
        while len(received) < sample_count and time.monotonic() < deadline_monotonic:
            sample, _ = inlet.pull_sample(timeout=0.2)
            if sample is not None:
                received.append(list(sample))
    except RuntimeError as exc:  # pylsl's TimeoutError, LostError and InternalError among others
        return CheckResult("LSL loopback", FAIL, f"{type(exc).__name__}: {exc}", lines)
    finally:
        # The inlet goes first: an outlet that vanishes under a connected inlet makes liblsl log
        # a "transmission broke off" error for nothing.
        if inlet is not None:
            inlet.close_stream()
        del inlet, outlet
    took_s = time.monotonic() - started_monotonic
    if received != sent:
        return CheckResult("LSL loopback", FAIL, (
            f"stream resolved, but {len(received)} of {sample_count} samples came back intact "
            f"within {timeout_s:g} s (a firewall blocking TCP on localhost?)"), lines)
    state = WARN if config_problem else OK
    return CheckResult("LSL loopback", state, (
        f"a stream on this machine resolved by source_id and {sample_count} samples read back "
        f"in {took_s:.2f} s"), lines)


# --- models --------------------------------------------------------------------------------------


def check_models(model_dir: str | os.PathLike | None = None) -> CheckResult:
    """Every MediaPipe model `facecast models install` provides, present and intact (SHA-256)."""
    from facecast.models import assets

    directory = assets.resolve_model_dir(model_dir)
    lines = []
    missing = damaged = 0
    for name in assets.MODELS:
        try:
            assets.model_path(name, directory)
        except assets.ModelMissing:
            missing += 1
            lines.append(f"{name}: missing")
        except (assets.ModelError, OSError) as exc:  # ModelChecksumError, or unreadable
            damaged += 1
            lines.append(f"{name}: damaged ({exc})")
        else:
            lines.append(f"{name}: ok")
    total = len(assets.MODELS)
    if missing or damaged:
        problems = ", ".join(part for part in (f"{missing} missing" if missing else "",
                                               f"{damaged} damaged" if damaged else "") if part)
        return CheckResult("models", FAIL, f"{problems} of {total} in {directory}; run "
                           f"`{assets.INSTALL_COMMAND}`", tuple(lines))
    # All present: one line of names, not seven lines of "ok".
    return CheckResult("models", OK, f"{total}/{total} installed and verified (SHA-256) in "
                       f"{directory}", (", ".join(assets.MODELS),))


def check_cpu_runtime(models_device: str = "auto",
                      model_dir: str | os.PathLike | None = None) -> CheckResult:
    """Where the models run without a GPU: LiteRT (XNNPACK) for the face detectors and the
    FaceLandmarker models, proven by loading the short-range detector in it (Note [LiteRT on
    the CPU]); PyTorch for the rest, and for all of them where LiteRT is missing."""
    import importlib.metadata

    import torch

    from facecast.models import anchors, assets
    from facecast.models.litert_models import LiteRTModel, LiteRTUnavailable

    if models_device != "cpu" and torch.cuda.is_available():
        return CheckResult("CPU runtime", OK, "not used: the models run on cuda, in PyTorch")
    try:
        path = assets.model_path(anchors.FACE_SHORT_RANGE.name, model_dir)
    except (assets.ModelError, OSError) as exc:
        return CheckResult("CPU runtime", WARN, f"not tried, no model to load: {exc}")
    try:
        LiteRTModel(path, threads=1)
    except LiteRTUnavailable as exc:
        return CheckResult("CPU runtime", WARN, f"{exc}: every model runs as a converted PyTorch "
                           "module, about twice LiteRT's time a face; `pip install ai-edge-litert`")
    return CheckResult("CPU runtime", OK, f"LiteRT {importlib.metadata.version('ai-edge-litert')} "
                       "(XNNPACK) runs the face detectors and FaceLandmarker's models, PyTorch the "
                       "attention mesh, body pose and face embeddings")


def check_gpu_kernels(models_device: str = "auto") -> CheckResult:
    """Whether Triton compiles and runs facecast's own kernels on the first GPU (Note [Kernels of
    our own]), proven with the crop kernel, compiled if this machine never did."""
    import torch

    from facecast.models import triton_kernels

    if models_device == "cpu" or not torch.cuda.is_available():
        return CheckResult("kernels", OK, "not used: the models run on the CPU")
    device = torch.device("cuda", 0)
    problem = triton_kernels.prepare(device, [(torch.float32, "replicate")])
    if problem is not None:
        return CheckResult("kernels", WARN, f"Triton cannot run facecast's kernels ({problem}): "
                           "PyTorch's kernels do their work instead, a little slower; Triton "
                           "needs a C compiler and the Python headers, as PyCUDA's build does")
    import triton

    return CheckResult("kernels", OK, f"Triton {triton.__version__} compiled and ran facecast's crop "
                       "kernel on cuda:0; its other kernels (detections' decoding, weighted NMS, "
                       "duplicate filter, transformation matrix, layer norms) compile at their first use")


def check_blendshapes(task_path: str | None = None,
                      model_dir: str | os.PathLike | None = None) -> CheckResult:
    """Whether the Face streams will carry blendshapes and head translation (they need
    face_landmarker.task), and where the bundle comes from."""
    from facecast.models import assets

    choice = assets.landmarker_bundle(task_path or None, model_dir)
    if not choice.available:
        # Optional: without it the daemon runs the attention mesh and leaves these channels out.
        return CheckResult("blendshapes", WARN, "blendshape and head translation channels not "
                           f"published: {choice.detail}")
    return CheckResult("blendshapes", OK, "published, with head translation (MediaPipe "
                       f"FaceLandmarker's models); bundle: {choice.detail}")


def check_face_embedding(model_dir: str | os.PathLike | None = None) -> CheckResult:
    """dlib's face embedding network (face identities), installed and intact (SHA-256)."""
    from facecast.models import assets

    try:
        path = assets.face_embedding_model_path(model_dir)
    except (assets.ModelError, OSError) as exc:
        # Optional: nothing in the daemon needs it yet; identities will.
        return CheckResult("embeddings", WARN, f"face embedding network unavailable: {exc}")
    return CheckResult("embeddings", OK, f"{path} (dlib's face ResNet, 128-D; from PyPI "
                       f"{assets.FACE_EMBEDDING_REQUIREMENT}, verified by SHA-256)")


def check_participants(configured_gallery: str = "") -> CheckResult:
    """The participants' gallery (facecast.shared.gallery): where it is, and whom it names."""
    from facecast.shared import gallery

    path = gallery.gallery_path(configured_gallery)
    try:
        current = gallery.load(path)
    except gallery.GalleryError as exc:
        # The daemon still runs; its faces go unnamed until the gallery is readable again.
        return CheckResult("participants", WARN, f"gallery unusable: {exc}")
    return CheckResult("participants", OK, current.describe())


# --- the command ---------------------------------------------------------------------------------


def run_checks(loaded: config.Config | None = None) -> Iterator[CheckResult]:
    """Every check in screen order; a generator so that each line shows as soon as it is known.
    The CUDA IPC proof runs only where CUDA IPC can be used (Note [Doctor's time])."""
    from facecast.shared.transport.cuda_driver import cuda_unavailable_reason

    models_device = loaded.models.device if loaded is not None else "auto"
    model_dir = (loaded.models.dir or None) if loaded is not None else None
    task_path = (loaded.models.face_landmarker_task or None) if loaded is not None else None
    yield check_gpu(models_device)
    yield check_nvml()
    yield check_transport(loaded)
    no_cuda = cuda_unavailable_reason()
    yield check_cuda_ipc() if not no_cuda else CheckResult(
        "CUDA IPC", WARN, f"not tried: {no_cuda}; frames go over shared memory (`facecast "
        "transport-check --transport shm` proves that between two processes)")
    yield check_nvdec(loaded)
    yield check_lsl_loopback()
    yield check_models(model_dir)
    yield check_cpu_runtime(models_device, model_dir)
    yield check_gpu_kernels(models_device)
    yield check_blendshapes(task_path, model_dir)
    yield check_face_embedding(model_dir)
    yield check_participants(loaded.participants.gallery if loaded is not None else "")


def format_result(result: CheckResult) -> str:
    head = f"  {result.state:<4}  {result.name:<12}  {result.detail}"
    return "\n".join([head] + [f"{'':22}{line}" for line in result.lines])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="check against this config (model dir, face_landmarker.task, "
                             "models.device, per-camera transports); default: the running "
                             "daemon's, else built-in defaults")
    parser.add_argument("--runtime-dir", default="",
                        help="the running daemon's runtime directory, to find its config")


def running_daemon_config(runtime_dir: str = "") -> tuple[str, str]:
    """(the running daemon's config file, which daemon) or ("", why none): asked over the
    control socket. A relative path is the daemon's, from its working directory."""
    from facecast.daemon.cli.control_client import NotRunning, request, runtime_dir_of
    from facecast.shared.transport.messages import StatusRequest

    try:
        where = runtime_dir_of(None, runtime_dir)
        status = request(where, StatusRequest(), timeout_s=3.0)
    except NotRunning as exc:
        return "", str(exc)
    path = Path(status.config_path)
    if not path.is_absolute():
        try:
            path = Path(os.readlink(f"/proc/{status.pid}/cwd")) / path
        except OSError as exc:
            return "", (f"the running daemon (pid {status.pid}) names its config {path}, relative "
                        f"to a working directory this user cannot read ({exc.strerror})")
    return str(path), f"the running daemon's, pid {status.pid} at {where}"


def main(args: argparse.Namespace) -> int:
    loaded = None
    path, whose = args.config, ""
    if not path:
        path, why_none = running_daemon_config(getattr(args, "runtime_dir", ""))
        whose = f" ({why_none})" if path else ""
        if not path:
            log.debug("doctor: no running daemon's config: %s", why_none)
    if path:
        try:
            loaded = config.load(path)
        except config.ConfigError as exc:
            print(f"facecast: {exc}", file=sys.stderr)
            return 2
    print("facecast doctor: what facecast will use on this machine, and why")
    print(f"config: {path + whose if path else 'none (built-in defaults; no daemon running here, '}"
          + ("" if path else "and no --config FILE)"))
    failed = []
    for result in run_checks(loaded):
        print(format_result(result), flush=True)
        if result.state == FAIL:
            failed.append(result.name)
    if failed:
        print(f"facecast cannot run here: {', '.join(failed)} failed")
        return 1
    print("facecast can run here")
    return 0
