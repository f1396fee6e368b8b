"""`facecast doctor`: each check on this machine, for real, and the command through argparse.

The LSL check runs on the loopback-only configuration that tests/conftest.py puts in $LSLAPICFG.
The GPU/IPC expectations are this CPU machine's (no GPU: auto uses shm, and says why); on a GPU
machine those tests skip, with the reason, and the `gpu` tests (tests/test_cuda_rules.py,
tests/test_daemon_gpu.py) cover the CUDA path.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from facecast.daemon import reporting
from facecast.daemon.cli import doctor
from facecast.models import assets
from facecast.shared import config as config_mod
from facecast.shared.transport.cuda_driver import cuda_unavailable_reason

no_gpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="expects a machine without a CUDA device (this one has one)")


def _run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="facecast doctor")
    doctor.add_arguments(parser)
    return doctor.main(parser.parse_args(argv))


def _installed_model_dir() -> Path:
    directory = assets.default_model_dir()
    if len(assets.installed(directory)) != len(assets.MODELS):
        pytest.skip(f"the models are not all installed in {directory} (run `facecast models "
                    "install`); the installed-cache checks need them")
    return directory


# --- LSL ------------------------------------------------------------------------------------------


def test_lsl_loopback_reads_its_samples_back_and_names_the_config():
    result = doctor.check_lsl_loopback(timeout_s=5.0, sample_count=5)
    assert result.state == doctor.OK, result
    assert "5 samples read back" in result.detail
    took_s = float(result.detail.rsplit(" in ", 1)[1].removesuffix(" s"))
    assert 0 < took_s < 5.0
    assert result.lines[0] == f"LSL config: {os.environ['LSLAPICFG']} (from $LSLAPICFG)"


def test_lsl_config_reports_an_unreadable_lslapicfg(monkeypatch, tmp_path):
    # Only the description is checked: liblsl has already read its config in this process.
    missing = tmp_path / "nope.cfg"
    monkeypatch.setenv("LSLAPICFG", str(missing))
    monkeypatch.chdir(tmp_path)  # no ./lsl_api.cfg to find instead
    monkeypatch.setenv("HOME", str(tmp_path))
    text, problem = doctor.lsl_config_in_effect()
    assert problem == f"$LSLAPICFG={missing} is not a readable file, so liblsl ignores it"
    if not Path("/etc/lsl_api/lsl_api.cfg").is_file():
        assert text.startswith("none: liblsl's defaults")

    (tmp_path / "lsl_api.cfg").write_text("[ports]\nIPv6 = disable\n")
    text, _ = doctor.lsl_config_in_effect()
    assert text.startswith(f"{tmp_path / 'lsl_api.cfg'} (no usable $LSLAPICFG")


def test_lsl_config_names_what_facecasts_quiet_copy_was_made_from(monkeypatch, tmp_path):
    from facecast.shared import third_party_logs

    original = tmp_path / "lab_lsl_api.cfg"
    original.write_text("[lab]\nKnownPeers = {127.0.0.1}\n")
    monkeypatch.setenv("LSLAPICFG", str(original))
    copy = third_party_logs.quiet_lsl(tmp_path)
    text, problem = doctor.lsl_config_in_effect()
    assert problem is None
    assert text == (f"{copy} (copy of {original}, with [log] level = -2 added (facecast "
                    "--verbose shows liblsl's own lines))")


# --- models ---------------------------------------------------------------------------------------


def test_models_in_an_empty_dir_fail_and_name_the_install_command(tmp_path):
    result = doctor.check_models(tmp_path)
    assert result.state == doctor.FAIL
    assert f"{len(assets.MODELS)} missing of {len(assets.MODELS)} in {tmp_path}" in result.detail
    assert "facecast models install" in result.detail
    assert result.lines == tuple(f"{name}: missing" for name in assets.MODELS)


def test_a_damaged_model_is_told_apart_from_a_missing_one(tmp_path):
    (tmp_path / "face_landmark.tflite").write_bytes(b"not the model")
    result = doctor.check_models(tmp_path)
    assert result.state == doctor.FAIL
    assert "1 damaged" in result.detail
    damaged = [line for line in result.lines if line.startswith("face_landmark:")]
    assert damaged and damaged[0].startswith("face_landmark: damaged (") and "SHA-256" in damaged[0]


def test_models_in_the_installed_cache_pass():
    directory = _installed_model_dir()
    result = doctor.check_models(directory)
    assert result.state == doctor.OK, result
    assert result.detail == (f"{len(assets.MODELS)}/{len(assets.MODELS)} installed and verified "
                             f"(SHA-256) in {directory}")


def test_blendshapes_without_a_task_file_warn_with_the_reason(tmp_path):
    result = doctor.check_blendshapes(None, tmp_path)
    assert result.state == doctor.WARN
    assert "not published" in result.detail
    assert f"face_landmarker.task is not installed in {tmp_path}" in result.detail
    assert "facecast models install" in result.detail

    not_a_bundle = tmp_path / "face_landmarker.task"
    not_a_bundle.write_bytes(b"plain text")
    result = doctor.check_blendshapes(str(not_a_bundle), tmp_path)
    assert result.state == doctor.WARN
    assert result.detail.endswith(f"{not_a_bundle} is not a face_landmarker.task bundle (not a zip file)")


def test_blendshapes_say_where_the_bundle_came_from():
    directory = _installed_model_dir()
    assets.install_landmarker_task(directory)
    result = doctor.check_blendshapes(None, directory)
    assert result.state == doctor.OK, result
    assert f"{directory / assets.LANDMARKER_TASK_FILE}" in result.detail
    assert assets.LANDMARKER_TASK_REQUIREMENT in result.detail


def test_status_names_the_face_stack_and_why(tmp_path):
    # The line `facecast status` prints (DaemonStatus.face_models), from the same choice.
    camera = '[[cameras]]\nid = "c0"\nsource = "synthetic"\n'
    empty = config_mod.loads(f'[models]\ndir = "{tmp_path}"\n' + camera)
    line = reporting.face_models_line(empty)
    assert line.startswith("attention mesh, no blendshapes"), line
    assert f"face_landmarker.task is not installed in {tmp_path}" in line
    directory = _installed_model_dir()
    assets.install_landmarker_task(directory)
    installed = config_mod.loads(f'[models]\ndir = "{directory}"\n' + camera)
    line = reporting.face_models_line(installed)
    assert line.startswith("MediaPipe FaceLandmarker"), line
    assert assets.LANDMARKER_TASK_REQUIREMENT in line


# --- GPU, NVML, transport -------------------------------------------------------------------------


@no_gpu_only
def test_gpu_check_reports_no_gpu_and_cpu_models():
    result = doctor.check_gpu("auto")
    assert result.state == doctor.WARN
    assert result.detail.startswith("no CUDA device visible to PyTorch")
    assert result.detail.endswith("models run on the CPU")
    # Asking for CUDA models on a machine without a GPU cannot run.
    assert doctor.check_gpu("cuda").state == doctor.FAIL


@no_gpu_only
def test_cpu_runtime_is_litert_proven_by_loading_a_model(installed_models, monkeypatch, tmp_path):
    """Note [LiteRT on the CPU]: doctor loads the short-range detector in LiteRT; without
    ai-edge-litert it says so and what runs instead; without the models it says why it did not try."""
    result = doctor.check_cpu_runtime("auto")
    assert result.state == doctor.OK
    assert re.match(r"LiteRT \d+\.\d+.* \(XNNPACK\) runs the face detectors", result.detail)
    assert doctor.check_cpu_runtime("auto", tmp_path).state == doctor.WARN
    assert "not tried, no model to load" in doctor.check_cpu_runtime("auto", tmp_path).detail
    monkeypatch.setitem(sys.modules, "ai_edge_litert.interpreter", None)  # its import fails
    missing = doctor.check_cpu_runtime("auto")
    assert missing.state == doctor.WARN
    assert missing.detail.startswith("ai-edge-litert is not installed")
    assert "converted PyTorch module" in missing.detail


def test_gpu_kernels_say_where_they_run_and_why_not(monkeypatch):
    """Note [Kernels of our own]: not used without a GPU; on one, Triton's failure to compile
    them is a warning that names the reason and what runs instead."""
    from facecast.models import triton_kernels

    assert doctor.check_gpu_kernels("cpu").detail == "not used: the models run on the CPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_kernels, "prepare", lambda device, crops: (
        "RuntimeError: Failed to find C compiler. Please specify via CC environment variable."))
    result = doctor.check_gpu_kernels("auto")
    assert result.state == doctor.WARN
    assert "Failed to find C compiler" in result.detail and "PyTorch's kernels" in result.detail


@no_gpu_only
def test_nvml_missing_is_a_line_not_a_traceback():
    result = doctor.check_nvml()
    assert result.state == doctor.WARN
    assert result.detail.startswith("NVML unavailable (")


def test_nvml_report_lists_driver_memory_and_utilisation(monkeypatch):
    # A stand-in pynvml: the real one needs the NVIDIA driver, which this test must not.
    class NVMLError(Exception):
        pass

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVMLError_LibraryNotFound=type("NVMLError_LibraryNotFound", (NVMLError,), {}),
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"570.86.15",
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: "NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=3 * 2**30,
                                                                     total=141 * 2**30),
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=42),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    result = doctor.check_nvml()
    assert result.state == doctor.OK
    assert result.detail == "NVIDIA driver 570.86.15, 1 GPU(s)"
    assert result.lines == ("nvml:0  NVIDIA H200, 3.0 of 141.0 GiB used, 42% busy",)


@no_gpu_only
def test_auto_transport_uses_shm_here_and_says_why():
    reason = cuda_unavailable_reason()
    assert reason
    result = doctor.check_transport()
    assert result.state == doctor.WARN
    assert result.detail == f"auto uses shm because {reason}"


@no_gpu_only
def test_cuda_ipc_validation_between_two_processes_falls_back_to_shm_here():
    result = doctor.check_cuda_ipc()  # spawns a real consumer process (a few seconds)
    assert result.state == doctor.WARN, result
    reason = cuda_unavailable_reason()
    assert result.detail.startswith(f"not used: {reason}; frames fall back to shm")
    # The consumer may skip a frame it was too late for (seen on a busy host): count > 0 suffices.
    frames = re.search(r"(\d+) frames verified byte for byte on shm, 0 wrong", result.detail)
    assert frames and int(frames[1]) > 0, result.detail


def test_cuda_ipc_wrong_frames_or_a_crash_fail():
    wrong = {"verified": 57, "wrong": 3, "transport": "cuda_ipc", "reason": ""}
    result = doctor.check_cuda_ipc(lambda requested: wrong)
    assert result.state == doctor.FAIL
    assert "57 frames verified byte for byte on cuda_ipc, 3 wrong" in result.detail

    def broken(requested):
        raise RuntimeError("consumer did not start")

    result = doctor.check_cuda_ipc(broken)
    assert result.state == doctor.FAIL
    assert result.detail.endswith("could not run: RuntimeError: consumer did not start")


# --- the command ----------------------------------------------------------------------------------


def test_a_bad_config_exits_2_and_names_the_key(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[models]\ndirectory = \"/x\"\n")
    assert _run_main(["--config", str(path)]) == 2
    assert "models.directory: unknown key" in capsys.readouterr().err


@no_gpu_only
def test_doctor_fails_without_models_and_says_which_check(tmp_path, capsys):
    path = tmp_path / "lab.toml"
    path.write_text(f'[models]\ndir = "{tmp_path / "empty"}"\n'
                    '[[cameras]]\nid = "cam0"\nsource = "synthetic"\n')
    assert _run_main(["--config", str(path)]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    state_of = {line.split()[1]: line.split()[0] for line in lines if line.startswith("  ") and
                line.split()[0] in (doctor.OK, doctor.WARN, doctor.FAIL)}
    assert state_of["models"] == doctor.FAIL
    assert state_of["LSL"] == doctor.OK
    assert state_of["GPU"] == doctor.WARN
    assert state_of["transport"] == doctor.WARN
    assert "camera cam0: transport = 'auto' -> shm" in out
    assert lines[-1] == "facecast cannot run here: models failed"


def test_doctor_passes_with_lsl_and_the_installed_models(tmp_path, capsys, monkeypatch):
    directory = _installed_model_dir()
    path = tmp_path / "lab.toml"
    path.write_text(f'[models]\ndir = "{directory}"\n'
                    '[[cameras]]\nid = "cam0"\nsource = "synthetic"\n')
    # The IPC proof already ran for real above; here only the verdict's effect on the exit code
    # matters, so a stand-in keeps the test quick.
    monkeypatch.setattr(doctor, "check_cuda_ipc",
                        lambda: doctor.CheckResult("CUDA IPC", doctor.WARN, "stand-in"))
    assert _run_main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"  {doctor.OK:<4}  {'models':<12}  {len(assets.MODELS)}/{len(assets.MODELS)}" in out
    assert f"  {doctor.OK:<4}  {'LSL loopback':<12}" in out
    assert "Traceback" not in out
    assert out.splitlines()[-1] == "facecast can run here"


@pytest.mark.daemon
def test_doctor_without_a_config_checks_the_running_daemons(installed_models, tmp_path, capsys,
                                                             monkeypatch):
    # Issue 21: doctor checked the built-in defaults while a daemon ran with another config.
    from daemon_harness import ready_daemon

    text = ('[daemon]\nwarm_standby = "off"\n[web]\nenabled = false\n'
            '[[cameras]]\nid = "doccam"\nsource = "synthetic-replay"\ntransport = "shm"\n'
            "width = 320\nheight = 240\nfps = 10\n")
    monkeypatch.setattr(doctor, "check_cuda_ipc",
                        lambda: doctor.CheckResult("CUDA IPC", doctor.WARN, "stand-in"))
    with ready_daemon(tmp_path, text) as daemon:
        _run_main(["--runtime-dir", str(daemon.runtime_dir)])
        out = capsys.readouterr().out
        assert (f"config: {daemon.config_path} (the running daemon's, pid {daemon.process.pid} "
                f"at {daemon.runtime_dir})") in out, out
        assert "camera doccam: transport = 'shm' -> shm" in out, out
    _run_main(["--runtime-dir", str(daemon.runtime_dir)])  # stopped: the defaults, and why
    assert "config: none (built-in defaults; no daemon running here" in capsys.readouterr().out


@no_gpu_only
def test_no_cuda_here_means_no_cuda_ipc_proof_and_says_why(monkeypatch):
    # Note [Doctor's time]: the two-process proof could only show shm here; it was most of
    # doctor's time on the 2-core CI machine.
    def proof():
        raise AssertionError("the CUDA IPC proof ran on a machine without CUDA")

    monkeypatch.setattr(doctor, "check_cuda_ipc", proof)
    result = next(r for r in doctor.run_checks() if r.name == "CUDA IPC")
    assert result.state == doctor.WARN
    assert result.detail.startswith(f"not tried: {cuda_unavailable_reason()}; frames go over "
                                    "shared memory"), result.detail
