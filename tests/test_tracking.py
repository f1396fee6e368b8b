"""Track ids (workers/inference/tracking.py): stable while a face stays, kept over a short
occlusion, and
taken only from blocks the supervisor granted (Note [Track id blocks])."""

import pytest

from facecast.daemon.track_ids import TrackIdAllocator
from facecast.workers.inference.tracking import TrackIds, TrackIdSource

FPS = 30.0


def _granted(allocator: TrackIdAllocator | None = None, worker: str = "roi_landmark:cpu:0",
             blocks: int = 1) -> TrackIdSource:
    """A worker's source holding `blocks` blocks from the (daemon's) allocator."""
    allocator = allocator or TrackIdAllocator()
    source = TrackIdSource()
    for _ in range(blocks):
        block = allocator.grant(worker)
        source.add(block.start, block.count)
    return source


def _box(cx, cy, size=100.0):
    return (cx - size / 2, cy - size / 2, cx + size / 2, cy + size / 2)


def test_two_moving_faces_keep_their_ids():
    ids = TrackIds(_granted())
    history = []
    for k in range(90):
        ts = 100.0 + k / FPS
        # Two faces moving toward each other by 4 px a frame; listed in alternating order.
        a, b = _box(200 + 4 * k, 300), _box(900 - 4 * k, 320)
        boxes = [a, b] if k % 2 == 0 else [b, a]
        got = ids.assign(boxes, ts)
        history.append(got if k % 2 == 0 else got[::-1])
    assert all(pair == history[0] for pair in history)
    assert len(set(history[0])) == 2


def test_id_survives_occlusion_up_to_hold_and_not_beyond():
    ids = TrackIds(_granted(), hold_s=1.0)
    first = ids.assign([_box(400, 300)], 10.0)[0]
    # Hidden for 0.8 s, reappears a little further along its path.
    for k in range(1, 24):
        assert ids.assign([], 10.0 + k / FPS) == []
    assert ids.assign([_box(430, 305)], 10.8) == [first]
    # Hidden for 1.5 s: a new person, as far as facecast can tell.
    assert ids.assign([], 10.9) == []
    assert ids.assign([_box(430, 305)], 12.4) != [first]


def test_a_newcomer_far_away_gets_a_new_id_while_the_first_is_occluded():
    ids = TrackIds(_granted(), hold_s=1.0)
    first = ids.assign([_box(200, 200)], 0.0)[0]
    assert ids.assign([], 0.1) == []
    newcomer = ids.assign([_box(1000, 600)], 0.2)[0]
    assert newcomer != first
    # ...and the first face, back where it was, still gets its own id.
    assert sorted(ids.assign([_box(1000, 600), _box(205, 200)], 0.3)) == sorted([newcomer, first])


# --- ids from granted blocks ---------------------------------------------------------------------


def test_cameras_of_a_worker_share_its_blocks_and_never_share_an_id():
    source = _granted()
    cameras = [TrackIds(source), TrackIds(source)]
    ids = [camera.assign([_box(200, 200), _box(600, 200)], 1.0) for camera in cameras]
    assert ids == [[1, 2], [3, 4]]  # the daemon's first block starts at 1


def test_a_restarted_worker_never_repeats_an_id_of_its_predecessor():
    # Regression: every roi_landmark process counted from 1, so after a SIGKILL (or a warm
    # standby's promotion) one recording had id 1 for two different people.
    allocator = TrackIdAllocator(block_size=8)
    before = TrackIds(_granted(allocator))
    seen = set()
    for k in range(5):  # five people come and go, one at a time
        seen.update(before.assign([_box(100 + 200 * k, 300)], 10.0 + 2 * k))
    after = TrackIds(_granted(allocator))  # the new process, its first block from the supervisor
    fresh = after.assign([_box(100, 300), _box(500, 300)], 30.0)
    assert seen == {1, 2, 3, 4, 5}
    assert fresh == [9, 10] and not set(fresh) & seen


def test_ids_run_through_blocks_in_order_and_ask_for_more_at_half():
    allocator = TrackIdAllocator(block_size=4)
    source = TrackIdSource()
    assert source.wants_more()  # nothing granted yet
    source.add(allocator.grant("w").start, 4)
    assert not source.wants_more()
    assert [source.take(), source.take()] == [1, 2]
    assert source.wants_more()  # half of the block left: the reserve covers the round trip
    block = allocator.grant("w")
    source.add(block.start, block.count)
    assert not source.wants_more()
    assert [source.take() for _ in range(6)] == [3, 4, 5, 6, 7, 8]
    assert source.take() is None and source.remaining == 0


def test_a_dry_source_names_no_newcomer_but_keeps_the_faces_it_follows():
    allocator = TrackIdAllocator(block_size=2)
    source = _granted(allocator)
    ids = TrackIds(source)
    assert ids.assign([_box(200, 200), _box(600, 200)], 1.0) == [1, 2]
    # A third person arrives while no block is left: no id, rather than one used before.
    assert ids.assign([_box(205, 200), _box(600, 205), _box(1000, 600)], 1.1) == [1, 2, None]
    assert ids.assign([_box(210, 200), _box(600, 210), _box(1000, 600)], 1.2) == [1, 2, None]
    block = allocator.grant("w")
    source.add(block.start, block.count)
    assert ids.assign([_box(215, 200), _box(600, 215), _box(1000, 600)], 1.3) == [1, 2, 3]


@pytest.mark.parametrize("start, count, reason", [
    (0, 4, "not within 1"),
    (5, 0, "not within 1"),
    ((1 << 24) - 2, 4, "not within 1"),
    (3, 4, "overlaps ids granted before"),
])
def test_a_block_out_of_range_or_overlapping_earlier_ones_is_refused(start, count, reason):
    source = TrackIdSource()
    source.add(1, 4)
    with pytest.raises(ValueError, match=reason):
        source.add(start, count)
    assert [source.take() for _ in range(5)] == [1, 2, 3, 4, None]
