"""MJPEG cameras decoded on the GPU: each compressed frame (a whole JPEG) demuxed on the CPU by
PyAV (gpu_decoded.PacketReader), decoded by nvImageCodec (`nvidia.nvimgcodec`, wheel
nvidia-nvimgcodec-cu13 0.9.0.20) into the camera's GPU, RGB → BGR in torch, and handed to the
ring as a device tensor (`FramePublisher.publish_decoded`; Note [Frames born on the GPU]).

Runs in the capture worker, on the camera's thread (Note [Camera threads]), and is imported only
where the GPU decoder is tried for MJPEG (nvdec.open_gpu_source): it imports torch and PyAV;
nvImageCodec is imported when a decoder is made. What of nvImageCodec is used was read from the
0.9.0.20 wheel's bound signatures on a machine without a GPU (where the module imports, its
CodeStream parses a JPEG, and making a Decoder with these arguments fails only for want of
libcuda.so); nothing in this module has run on a GPU in the session that wrote it. The sources' demuxing, pacing, positions, looping, stamping
and fallbacks ran on the CPU with OpenCV playing nvImageCodec's part (tests/test_mjpeg_decoding.py,
`CpuJpeg`); the real decode is for the `gpu` tests (tests/test_nvjpeg_gpu.py).

Note [nvJPEG path]
    Sources: an MJPEG file or HTTP/RTSP stream (what nvdec.open_gpu_source's PacketReader finds
    to be `mjpeg` is handed here, already open: an HTTP camera is not connected to twice) and
    "synthetic-mjpeg" (the encoded synthetic loop, Note [Encoded synthetic loop]). Each packet
    of an MJPEG stream is one whole JPEG, stamped with `pylsl.local_clock()` when the demuxer
    hands it over, as on the NVDEC path; a file is played at its rate and stamped when the pacer
    hands a frame out, as FileSource's; "synthetic-mjpeg" as its CPU twin. JPEG is intra-only, so
    a late reader of the synthetic loop skips packets without decoding them.
    Decoder: one `nvimgcodec.Decoder` per camera on the camera's GPU, its work on a CUDA stream
    of the camera's own (`cuda_stream=`), first with the hardware JPEG engine alone
    (`Backend(BackendKind.HW_GPU_ONLY)`), else with nvImageCodec's default backends (all it has:
    the hardware engine, the CUDA nvJPEG decoder, the CPU ones), whose output is still device
    memory. Issue 22 measured both on an H100 (1080p in 1.5-2 ms warm, within one grey level of
    OpenCV) and found `GPU_ONLY` failing to make a decoder ("Could not create decoder", code 7),
    so it is not asked for. Which backend a camera got is in its decoder's reason. The first
    JPEG is decoded at open: that is where a decoder that cannot be made, or a JPEG the backend
    cannot take (the hardware engine's limits: baseline JPEG), shows, and it is the warm-up
    (nvImageCodec's first decode in a process took 1-1.6 s; issue 22), paid at open rather than
    on a live frame. Whether that cost is per process or per decoder is not measured.
    Output: nvImageCodec decodes to interleaved RGB (its default, `ColorSpec.SRGB`, JFIF's
    full-range BT.601) into an Image the decoder reuses frame after frame (`image=`, stream
    order on the camera's stream keeps the next decode from overwriting a frame before it is
    converted); `torch.as_tensor` sees it through `__cuda_array_interface__` (row pitch honoured)
    and the channels are flipped into a new BGR tensor on the same stream, the producer-private
    frame whose checksum the ring computes. EXIF orientation is not applied (a camera's frames
    are what its sensor saw, as OpenCV's FFMPEG backend gives them). A decode that gives no
    image (nvImageCodec returns None rather than raising) is a failure like an exception.
    Not batched across a capture group's cameras: each camera has its own thread, source and
    pace (Note [Camera threads]), and a batch would make the first camera's frame wait for the
    others' (up to a frame period), tie every camera of a batch to the slowest and to the one
    whose JPEG fails, where Note [GPU decoder failing mid-stream] wants one camera to fall back
    alone. The H100's seven JPEG engines are shared by the cameras' concurrent decodes instead;
    whether nvImageCodec releases the GIL while it decodes, which that concurrency needs, is
    not verified: if the decode-stage bench shows the threads serialised there, a per-worker
    batcher is the next step.
    USB (V4L2) MJPEG cameras stay on the CPU for now. OpenCV's V4L2 backend can hand the bytes
    over: with `CAP_PROP_CONVERT_RGB` = 0 its retrieveFrame copies the driver's buffer as it
    came (`bytesused` bytes, a 1 x N frame for MJPEG; read in OpenCV's
    modules/videoio/src/cap_v4l.cpp), so a V4L2 twin of these sources is the way. Not built
    here because nothing of it could be tried (no USB camera on this machine or the GPU one),
    a driver that grants YUYV instead of the asked MJPG gives raw frames through the same call
    (the twin must check the granted fourcc), and UVC cameras may send JPEGs without Huffman
    tables (FFmpeg's and libjpeg's decoders supply the standard ones; whether nvImageCodec
    does is unknown).
"""

from __future__ import annotations

import logging

import pylsl
import torch

from facecast.shared.config import CameraConfig
from facecast.workers.capture import decoding
from facecast.workers.capture.decoding import (
    JPEG_CODECS,
    DecodeChoice,
    DecodeRequest,
    GpuDecodeFailed,
    GpuDecodeUnavailable,
)
from facecast.workers.capture.gpu_decoded import (
    EncodedLoopPlayback,
    FilePlayback,
    GpuDecodedSource,
    PacketReader,
    StreamPlayback,
    error_text,
)
from facecast.workers.capture.sources import Granted, video_file_path

log = logging.getLogger(__name__)

BACKENDS = ("hardware", "default")  # tried in this order at open (Note [nvJPEG path])
_BACKEND_NAMES = {"hardware": "nvImageCodec's hardware JPEG engine",
                  "default": "nvImageCodec's default backends"}


class JpegDecoder:
    """One nvImageCodec decoder on the camera's GPU and CUDA stream (Note [nvJPEG path]).

    nvImageCodec 0.9.0.20's API as its wheel states it: Decoder(device_id, max_num_cpu_threads,
    backends, options), Backend(backend_kind, load_hint, load_hint_policy),
    BackendKind.HW_GPU_ONLY, DecodeParams(apply_exif_orientation, color_spec, allow_any_depth,
    sample_format), ColorSpec.SRGB, CodeStream(bytes), Decoder.decode(src, image, params,
    cuda_stream) -> Image or None, Image.__cuda_array_interface__. Not run on a GPU here."""

    def __init__(self, device_index: int, stream: torch.cuda.Stream, backend: str) -> None:
        from nvidia import nvimgcodec  # decoding.nvjpeg_unavailable_reason said it loads

        self._nvimgcodec = nvimgcodec
        self.backend = backend
        self.device = torch.device("cuda", device_index)
        self._cuda_stream = int(stream.cuda_stream)
        backends = ([nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)]
                    if backend == "hardware" else None)  # None: all, with their defaults
        # One CPU thread: the CPU backends are a last resort of the default set, and a capture
        # worker's cameras are many threads already.
        self._decoder = nvimgcodec.Decoder(device_id=device_index, max_num_cpu_threads=1,
                                           backends=backends)
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                               color_spec=nvimgcodec.ColorSpec.SRGB,
                                               allow_any_depth=False)
        self._image = None  # reused frame after frame (its buffer is the decoder's own)
        self._code_stream = None

    def decode(self, data: bytes) -> torch.Tensor:
        """The JPEG as an H x W x 3 uint8 RGB tensor on the device: a view of the decoder's
        image, valid until the next decode, ready in the order of the decoder's stream. Raises
        RuntimeError where nvImageCodec gives no image."""
        code_stream = self._nvimgcodec.CodeStream(data)
        image = self._decoder.decode(code_stream, image=self._image, params=self._params,
                                     cuda_stream=self._cuda_stream)
        if image is None:
            raise RuntimeError(f"{_BACKEND_NAMES[self.backend]} gave no image for a "
                               f"{len(data)}-byte JPEG")
        self._image = image
        # Kept until the next decode, which stream order puts after this one: whether the
        # CodeStream copies the bytes and whether any of the decode reads them after `decode`
        # returns is not documented (not verified either way).
        self._code_stream = code_stream
        rgb = torch.as_tensor(image, device=self.device)
        if rgb.dim() != 3 or rgb.shape[2] != 3 or rgb.dtype != torch.uint8:
            raise RuntimeError(f"nvImageCodec gave a {tuple(rgb.shape)} {rgb.dtype} image, not "
                               "H x W x 3 uint8 RGB")
        return rgb

    def close(self) -> None:
        self._image = self._code_stream = None
        self._decoder = None  # its destructor frees its resources


class NvjpegSource(GpuDecodedSource):
    """A camera's MJPEG decoded by nvImageCodec (Note [nvJPEG path])."""

    backend = "nvJPEG"

    def __init__(self, camera: CameraConfig, request: DecodeRequest) -> None:
        super().__init__(camera, request)
        self.decoder: JpegDecoder | None = None

    # -- opening

    def _start(self, reader: PacketReader) -> tuple[torch.Tensor, float]:
        """Check what the reader found, make the decoder on the first JPEG (the warm-up, Note
        [nvJPEG path]); returns that frame (BGR) and its read time. GpuDecodeUnavailable says
        why the GPU cannot take the camera."""
        self.reader = reader
        if reader.codec not in JPEG_CODECS:
            raise GpuDecodeUnavailable(f"its video is {reader.codec or 'of an unknown codec'}, "
                                       "not MJPEG")
        packet = self._next_packet_or_lost()
        if packet is None:
            raise GpuDecodeUnavailable(f"{self._describe(reader)} ended before its first frame")
        data, _, read_ts = packet
        failures = []
        for backend in BACKENDS:
            try:
                self.decoder = JpegDecoder(self.device_index, self.stream, backend)
                first = self._convert(self.decoder.decode(data))
                self.stream.synchronize()  # a failure of the first decode shows here, at open
                break
            except Exception as exc:  # noqa: BLE001 - "Could not create decoder", None, CUDA
                failures.append(f"{_BACKEND_NAMES[backend]}: {error_text(exc)}")
                if self.decoder is not None:
                    self.decoder.close()
                    self.decoder = None
        else:
            raise GpuDecodeUnavailable("nvImageCodec could not decode its first JPEG ("
                                       + "; ".join(failures) + ")")
        self.frames_decoded += 1
        self._primed = True
        height, width = int(first.shape[0]), int(first.shape[1])
        fallback = f" ({failures[0]})" if failures else ""
        self.decode = DecodeChoice("gpu", f"{self.request.asked()}: {self._describe(reader)} on "
                                   f"{_BACKEND_NAMES[self.decoder.backend]}{fallback} "
                                   f"(GPU {self.device_index})")
        self.granted = Granted(width, height, reader.fps or self.camera.fps, reader.codec,
                               self.backend)
        return first, read_ts

    @staticmethod
    def _describe(reader: PacketReader) -> str:
        return f"MJPEG {reader.width}x{reader.height}"

    # -- decoding

    def _decode(self, data: bytes) -> torch.Tensor:
        """One JPEG as a new BGR tensor on the camera's stream; GpuDecodeFailed once primed."""
        try:
            frame = self._convert(self.decoder.decode(data))
        except Exception as exc:  # noqa: BLE001 - whatever nvImageCodec or CUDA raised
            raise GpuDecodeFailed(f"nvImageCodec failed on a JPEG ({error_text(exc)})") from exc
        if (frame.shape[1], frame.shape[0]) != (self.granted.width, self.granted.height):
            raise self._lost(f"frame size changed from {self.granted.width}x"
                             f"{self.granted.height} to {frame.shape[1]}x{frame.shape[0]}; "
                             "reopen to renegotiate")
        self.frames_decoded += 1
        return frame

    def _convert(self, rgb: torch.Tensor) -> torch.Tensor:
        """RGB (a view of the decoder's image) → a new contiguous BGR tensor, on the camera's
        stream (Note [nvJPEG path])."""
        with torch.cuda.stream(self.stream):
            return rgb.flip(-1).contiguous()


class NvjpegFileSource(FilePlayback, NvjpegSource):
    """An MJPEG video file, looped and paced at its native fps, as sources.FileSource, decoded
    on the GPU."""

    def __init__(self, camera: CameraConfig, request: DecodeRequest,
                 reader: PacketReader) -> None:
        super().__init__(camera, request)
        self.path = video_file_path(camera)
        try:
            self._first, _ = self._start(reader)
        except BaseException:
            self.close()
            raise
        self._play()

    def _read_frame(self) -> tuple[torch.Tensor, float]:
        self._pacer.wait()
        if self._first is not None:
            frame, self._first = self._first, None
        else:
            packet = self.reader.read()
            if packet is None:
                self._open_next_round()
                packet = self.reader.read()
            frame = self._decode(packet[0])
        return frame, pylsl.local_clock()  # a file's frame is captured when handed out


class NvjpegStreamSource(StreamPlayback, NvjpegSource):
    """An HTTP (or RTSP) MJPEG stream, demuxed by PyAV, decoded on the GPU; frames as fast as
    they come, as sources.StreamSource."""

    def __init__(self, camera: CameraConfig, request: DecodeRequest, reader: PacketReader, *,
                 read_timeout_s: float = 5.0) -> None:
        super().__init__(camera, request)
        self.url = str(camera.source)
        self.read_timeout_s = read_timeout_s
        try:
            self._first = self._start(reader)
        except BaseException:
            self.close()
            raise
        self._play()

    def _read_frame(self) -> tuple[torch.Tensor, float]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        data, _, read_ts = self._next_packet_or_ended()
        return self._decode(data), read_ts


class NvjpegEncodedSyntheticSource(EncodedLoopPlayback, NvjpegSource):
    """"synthetic-mjpeg" decoded on the GPU (EncodedLoopPlayback); a late reader's skipped
    frames are skipped undecoded (JPEG is intra-only)."""

    kind = "synthetic-mjpeg"

    def __init__(self, camera: CameraConfig, request: DecodeRequest) -> None:
        super().__init__(camera, request)
        self._encode_loop()
        try:
            self._start(self._open_loop())  # file frame 0: the warm-up
        except BaseException:
            self.close()
            raise
        self._play(next_position=1)

    def _read_frame(self) -> tuple[torch.Tensor, float]:
        capture_ts_lsl, position = self._next_capture()
        while self._next_position % self.encoded.frame_count != position:
            self._next_loop_packet()  # skipped, not decoded
        return self._decode(self._next_loop_packet()[0]), capture_ts_lsl


def open_jpeg_source(camera: CameraConfig, kind: str, request: DecodeRequest,
                     reader: PacketReader | None = None, *,
                     read_timeout_s: float = 5.0) -> NvjpegSource:
    """The camera's MJPEG source on nvImageCodec: "synthetic-mjpeg", or a file or stream whose
    open PacketReader (nvdec.open_gpu_source's) found MJPEG; GpuDecodeUnavailable (the CPU
    decoder takes it), or SourceLost."""
    reason = decoding.nvjpeg_unavailable_reason()  # plan asked it for "synthetic-mjpeg" only
    if reason or reader is None and kind != "synthetic-mjpeg" or kind not in (
            "synthetic-mjpeg", "stream", "file"):
        if reader is not None:
            reader.close()
        raise GpuDecodeUnavailable(reason or f"a {kind} source is not decoded by nvJPEG")
    if kind == "synthetic-mjpeg":
        return NvjpegEncodedSyntheticSource(camera, request)
    try:
        if kind == "stream":
            return NvjpegStreamSource(camera, request, reader, read_timeout_s=read_timeout_s)
        return NvjpegFileSource(camera, request, reader)
    except BaseException:
        reader.close()  # the source's own close may have closed it: closing twice is harmless
        raise
