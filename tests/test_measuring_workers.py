"""How many roi_landmark workers a device gets (Note [Measuring workers per GPU]): one per 32
of a GPU's cameras by default, one on the CPU, or what `daemon.roi_landmark_workers` says."""

from __future__ import annotations

import pytest

from facecast.daemon import layout
from facecast.shared import config as config_mod


def _config(count: int, workers: str = '"auto"') -> config_mod.Config:
    cameras = "".join(f'[[cameras]]\nid = "c{k:02d}"\nsource = "synthetic"\n'
                      for k in range(count))
    return config_mod.loads(f"[daemon]\nroi_landmark_workers = {workers}\n{cameras}")


def _measuring(config: config_mod.Config, gpus: int) -> dict[str, tuple[str, ...]]:
    return {s.name: s.camera_ids for s in layout.plan(config, gpus) if s.role == "roi_landmark"}


def test_auto_gives_a_gpu_one_worker_per_32_cameras():
    assert list(_measuring(_config(32), 1)) == ["roi_landmark:cuda:0:0"]
    workers = _measuring(_config(64), 1)
    assert list(workers) == ["roi_landmark:cuda:0:0", "roi_landmark:cuda:0:1"]
    # The cameras dealt out in config order, each to exactly one worker.
    assert workers["roi_landmark:cuda:0:0"][:2] == ("c00", "c02")
    assert sorted(c for share in workers.values() for c in share) == [f"c{k:02d}" for k in range(64)]
    assert len(_measuring(_config(33), 1)) == 2 and len(_measuring(_config(65), 1)) == 3
    # Two GPUs, 32 cameras each (round-robin): one worker each.
    assert list(_measuring(_config(64), 2)) == ["roi_landmark:cuda:0:0", "roi_landmark:cuda:1:0"]


def test_auto_gives_the_cpu_one_worker():
    assert list(_measuring(_config(64), 0)) == ["roi_landmark:cpu:0"]


def test_a_fixed_count_is_kept_but_never_above_the_cameras():
    assert len(_measuring(_config(4, "3"), 0)) == 3
    assert len(_measuring(_config(64, "1"), 1)) == 1
    assert len(_measuring(_config(2, "4"), 1)) == 2  # a worker without a camera would idle


@pytest.mark.parametrize("value", ["0", "17", '"many"'])
def test_a_count_out_of_range_is_refused_naming_the_key(value):
    with pytest.raises(config_mod.ConfigError, match="roi_landmark_workers"):
        _config(2, value)


def test_workers_and_their_spares_are_warmed_for_the_largest_share_of_their_device():
    """Note [Warmed for the largest share]: what an Assignment's most_cameras says."""
    assert layout.most_cameras(_config(64), 1, "roi_landmark", "cuda:0") == 32
    assert layout.most_cameras(_config(65), 1, "roi_landmark", "cuda:0") == 22  # 22, 22, 21
    assert layout.most_cameras(_config(64), 1, "detection", "cuda:0") == 64
    # Two GPUs: each device's own cameras only.
    assert layout.most_cameras(_config(64), 2, "roi_landmark", "cuda:1") == 32
    assert layout.most_cameras(_config(64), 2, "detection", "cuda:0") == 32
    assert layout.most_cameras(_config(64), 0, "roi_landmark", "cpu") == 64
    assert layout.most_cameras(_config(64), 1, "roi_landmark", "cuda:1") == 0  # no such worker
