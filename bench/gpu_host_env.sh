# Source this on the offline GPU test host (Python 3.12, torch+CUDA, numpy, OpenCV preinstalled;
# no package index) from the repository root:   . bench/gpu_host_env.sh
#
# It expects git-ignored folders carried along with the working tree:
#   .whl/     the cp312 wheels that host lacks (pyzmq, pylsl, pycuda built against CUDA 13 with its
#             pytools, platformdirs, mako and siphash24, msgspec, tflite, setproctitle, and
#             ai-edge-litert and flatbuffers (the CPU stacks' runtime of the FaceLandmarker models,
#             Note [LiteRT on the CPU], and the LiteRT parity tests' truth), py-spy (bench/pipeline.py
#             --profile-roles) and rtsp 2.0.1 (25 kB, pure Python: the H.264 RTSP camera of
#             tests/rtsp_peer.py, which needs PyAV from .whl2a/): `pip download --no-deps --only-binary=:all: --python-version
#             3.12 --platform manylinux_2_28_x86_64 NAME` on a machine with an index
#             (ai-edge-litert: manylinux_2_17, 1.4.0, 11 MB); pycuda has no wheel there and is
#             built on such a host from its sdist), installed into /tmp/fc/site;
#   .models/  MediaPipe's .tflite files (`facecast models install` puts them in the model cache)
#             and test_photos.npz (the astronaut and grace_hopper photos: that host has neither
#             scikit-image nor matplotlib; tests/footage.py reads $FACECAST_TEST_PHOTOS); dlib's
#             embedding network only where its own tests are to run (31 MB);
#   .footage/ optional: real video files (../shared/footage/*.mp4) for bench/real_footage.py and
#             tests/test_real_footage_gpu.py ($FACECAST_REAL_FOOTAGE).
#   .whl2a/, .whl2b/  optional: wheels too big to carry with the rest (PyAV 36 MB, PyNvVideoCodec
#             27 MB, for the NVDEC path and tests/test_nvdec_gpu.py): carry one per call while the
#             machine stays warm; each is installed into /tmp/fc/<folder> the call it comes, and
#             stays on the path for later calls to the same machine.
#   .whl2c/   optional: nvidia-nvimgcodec-cu13 0.9.0.20 (25 MB, py3-none-manylinux_2_28_x86_64),
#             for the nvJPEG path and tests/test_nvjpeg_gpu.py (which needs PyAV too: .whl2a/),
#             carried and installed the same way.
# The repository is not pip-installed there: facecast.* is a namespace of symlinks to its folders,
# which is what pyproject's package-dir does for an installed copy.
set -e
_fc_root=/tmp/fc
if [ ! -d "$_fc_root/site" ] && [ -d .whl ]; then  # (a call carrying only .whl2a/, say)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$_fc_root/site" .whl/*.whl
fi
for _extra in .whl2a .whl2b .whl2c; do
    if [ -d "$_extra" ] && [ ! -d "$_fc_root/$_extra" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$_fc_root/$_extra" "$_extra"/*.whl
    fi
done
mkdir -p "$_fc_root/pkg/facecast"
for _part in daemon workers shared models; do
    ln -sfn "$PWD/$_part" "$_fc_root/pkg/facecast/$_part"
done
export PYTHONPATH="$_fc_root/pkg:$_fc_root/site:$_fc_root/.whl2a:$_fc_root/.whl2b:$_fc_root/.whl2c${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_fc_root/site/bin:$PATH"
export FACECAST_MODEL_DIR="$PWD/.models"
export FACECAST_TEST_PHOTOS="$PWD/.models/test_photos.npz"
export PYTHONUNBUFFERED=1
set +e
