"""Config decoding: typed, strict, errors that name the key and what is allowed, all of them at
once (DESIGN §6)."""

from pathlib import Path

import pytest

from facecast.shared import config

ROOT = Path(__file__).resolve().parents[1]


def test_default_config_loads_with_two_synthetic_cameras():
    loaded = config.load(ROOT / "config" / "default.toml")
    assert [c.id for c in loaded.cameras] == ["synth0", "synth1"]
    assert all(c.source == "synthetic" for c in loaded.cameras)
    assert loaded.transport_for(loaded.cameras[0]) == "auto"


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[daemon]\ntransport = "gpu"', "daemon.transport: Invalid enum value 'gpu' (allowed: 'auto', 'cuda_ipc', 'shm'"),
        ("[daemon]\nring_slot = 8", "daemon.ring_slot: unknown key (allowed here: runtime_dir"),
        ("[daemon]\nring_slots = 1", "daemon.ring_slots: Expected `int` >= 2"),
        ('[[cameras]]\nid = "a b"\nsource = 0', "cameras[0].id: Expected `str` matching regex"),
        ('[[cameras]]\nid = "a"\nsource = 0\nfps = 0', "cameras[0].fps: Expected `float` > 0.0"),
        ('[[cameras]]\nid = "a"\nsource = 0\ntransport = "x"', "cameras[0].transport: Invalid enum value 'x'"),
        ('[[cameras]]\nid = "a"\nsource = 0\n[[cameras]]\nid = "a"\nsource = 1', "camera id 'a' appears twice"),
        ("[daemon\n", "not valid TOML"),
        ('[[cameras]]\nsource = 0', "cameras[0]: Object missing required field `id`"),
        ('[daemon]\nhandshake_timeout_s = 5.0\n[[cameras]]\nid = "a"\nsource = 0',
         "daemon.handshake_timeout_s: removed: nothing waited on it"),
        ('[output]\npose = "yes"', "output.pose: Expected `bool`, got `str` (allowed: bool; measure body pose"),
        ("[output]\nbody_pose = true", "output.body_pose: unknown key (allowed here: max_faces, landmarks, pose)"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(text, expected):
    with pytest.raises(config.ConfigError) as error:
        config.loads(text, origin="lab.toml")
    assert str(error.value).startswith("lab.toml: ")
    assert expected in str(error.value)


def test_camera_transport_overrides_the_daemon_default():
    loaded = config.loads('[daemon]\ntransport = "cuda_ipc"\n[[cameras]]\nid = "a"\nsource = 0\ntransport = "shm"\n[[cameras]]\nid = "b"\nsource = 1')
    assert [loaded.transport_for(c) for c in loaded.cameras] == ["shm", "cuda_ipc"]


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(config.ConfigError, match="cannot read config file"):
        config.load(tmp_path / "nope.toml")


CAMERA = '[[cameras]]\nid = "a"\nsource = 0\n'


def test_every_problem_is_reported_at_once_each_with_its_key_path():
    text = ('[daemon]\ntransport = "gpu"\nring_slots = 1\nring_slot = 8\n'
            '[output]\npose = "yes"\n'
            '[[cameras]]\nid = "a b"\nfps = 0\n'
            '[[cameras]]\nid = "c"\nsource = 0\n[[cameras]]\nid = "c"\nsource = 1\n'
            '[extras]\nx = 1\n')
    with pytest.raises(config.ConfigError) as error:
        config.loads(text, origin="lab.toml")
    head, *problems = str(error.value).splitlines()
    assert head == f"lab.toml: {len(problems)} problems:"
    keys = [problem.strip().split(": ", 1)[0] for problem in problems]
    assert keys == ["daemon.transport", "daemon.ring_slots", "daemon.ring_slot", "output.pose",
                    "cameras[0].id", "cameras[0].fps", "cameras[0]", "extras",
                    "camera id 'c' appears twice; ids must be unique"]
    assert "(allowed: 'auto', 'cuda_ipc', 'shm'" in problems[0]
    assert "Object missing required field `source`" in problems[6]


def test_one_problem_is_one_line_as_before():
    with pytest.raises(config.ConfigError) as error:
        config.loads('[daemon]\nring_slots = 1\n' + CAMERA, origin="lab.toml")
    assert str(error.value).startswith("lab.toml: daemon.ring_slots: Expected `int` >= 2")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text", ["", "[daemon]\nring_slots = 4\n", "cameras = []\n"])
def test_a_config_without_cameras_is_refused_with_the_reason(text):
    with pytest.raises(config.ConfigError) as error:
        config.loads(text, origin="lab.toml")
    assert str(error.value) == (
        "lab.toml: cameras: no camera configured: add at least one [[cameras]] table with an id "
        'and a source (config/default.toml has two with source = "synthetic")')


def test_a_file_without_cameras_is_enough_where_cameras_are_not_required():
    """`facecast analyze` reads the models, output, daemon and participants tables only: a file
    of those is its config, checked as strictly as a daemon's."""
    loaded = config.loads("[output]\nmax_faces = 3\n", cameras_required=False)
    assert loaded.output.max_faces == 3 and loaded.cameras == []
    with pytest.raises(config.ConfigError, match="output.max_face: unknown key"):
        config.loads("[output]\nmax_face = 3\n", origin="a.toml", cameras_required=False)
    with pytest.raises(config.ConfigError, match="camera id 'a' appears twice"):
        config.loads('[[cameras]]\nid = "a"\nsource = "synthetic"\n' * 2,
                     cameras_required=False)


@pytest.mark.parametrize("source", ["rtsp://lab:pa55word@10.1.2.3:554/s1",
                                    "rtsp://lab:p@ss/1@10.1.2.3:554/s1"])  # an '@' in it too
def test_check_config_masks_an_rtsp_password(tmp_path, capsys, source):
    from facecast.daemon.cli import main as cli

    path = tmp_path / "lab.toml"
    path.write_text(f'[[cameras]]\nid = "ip0"\nsource = "{source}"\n')
    assert cli.main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out == f"{path}: ok; cameras: ip0 (rtsp://lab:***@10.1.2.3:554/s1, auto)\n"


@pytest.mark.parametrize("text, masked", [
    ("rtsp://user:pw@host:554/x", "rtsp://user:***@host:554/x"),
    ("cannot open rtsps://u:p%40ss@cam/a in 5 s", "cannot open rtsps://u:***@cam/a in 5 s"),
    ("http://cam.local/video.mjpg", "http://cam.local/video.mjpg"),
    ("rtsp://onlyuser@host/x", "rtsp://onlyuser@host/x"),
])
def test_redact_url_masks_only_the_password(text, masked):
    assert config.redact_url(text) == masked


@pytest.mark.parametrize("text, masked", [
    # Note [Masking passwords]: passwords as users write them.
    ("rtsp://lab:pa/ss@10.1.2.3:554/s1", "rtsp://lab:***@10.1.2.3:554/s1"),
    ("rtsp://lab:pa ss@10.1.2.3/s1", "rtsp://lab:***@10.1.2.3/s1"),
    ("rtsp://lab:p@ss@10.1.2.3/s1", "rtsp://lab:***@10.1.2.3/s1"),
    ("rtsp://lab:p@ss w/rd@10.1.2.3/s1", "rtsp://lab:***@10.1.2.3/s1"),
    ("rtsp://:pass@10.1.2.3/s1", "rtsp://:***@10.1.2.3/s1"),
    ("rtsp://:@10.1.2.3/s1", "rtsp://:***@10.1.2.3/s1"),
    ("camera a: cannot open rtsp://u:p@1/x in 5 s; camera b: rtsp://v:q/2@h2/y",
     "camera a: cannot open rtsp://u:***@1/x in 5 s; camera b: rtsp://v:***@h2/y"),
    ("rtsp://cam:554/s1 lost\nrtsp://u:se cret@h/x", "rtsp://cam:554/s1 lost\nrtsp://u:***@h/x"),
])
def test_redact_url_masks_passwords_with_slashes_spaces_and_at_signs(text, masked):
    assert config.redact_url(text) == masked
    for secret in ("pa/ss", "pa ss", "p@ss", "ss@", "pass", "se cret", "q/2"):
        assert secret not in config.redact_url(text)


@pytest.mark.parametrize("source, expected", [
    ("/dev/video97", "/dev/video97: no such file or directory (allowed: a V4L2 device of this "
                     "machine; `facecast cameras` lists them)"),
    (97, "/dev/video97: no such file or directory"),
    ("@MISSING@", "@MISSING@: no such video file"),
    ("file://@MISSING@", "@MISSING@: no such video file"),
    ("/dev/shm", "/dev/shm: not a device (allowed: a V4L2 device such as /dev/video0)"),
    ("synthetic-h265", "unknown synthetic source 'synthetic-h265' (allowed: 'synthetic', "),
])
def test_check_config_reports_a_source_that_can_never_work(tmp_path, capsys, source, expected):
    """Issue 21: a camera that is not there was 'ok' and the daemon retried it forever."""
    from facecast.daemon.cli import main as cli

    missing = str(tmp_path / "no-such-clip.mp4")
    if isinstance(source, str):
        source = source.replace("@MISSING@", missing)
    expected = expected.replace("@MISSING@", missing)
    path = tmp_path / "lab.toml"
    value = source if isinstance(source, int) else f'"{source}"'
    path.write_text(f'[[cameras]]\nid = "cam0"\nsource = {value}\n')
    code = cli.main(["check-config", str(path)])
    captured = capsys.readouterr()
    assert code == 1, captured
    assert captured.err.startswith(f"facecast: {path}: cameras.cam0.source: {expected}"), \
        captured.err
    assert captured.out.startswith(f"{path}: valid, but 1 camera source(s) cannot work on this "
                                   "machine; cameras: cam0 ("), captured.out


def test_check_config_accepts_a_video_file_that_is_there(tmp_path, capsys):
    from facecast.daemon.cli import main as cli

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\0" * 16)  # its content is the capture worker's to judge
    path = tmp_path / "lab.toml"
    path.write_text(f'[[cameras]]\nid = "cam0"\nsource = "{clip}"\n')
    assert cli.main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: ok;")
