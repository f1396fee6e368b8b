"""Track ids (workers/tracking.py): stable while a face stays, kept over a short occlusion."""

from facecast.workers.tracking import TrackIds

FPS = 30.0


def _box(cx, cy, size=100.0):
    return (cx - size / 2, cy - size / 2, cx + size / 2, cy + size / 2)


def test_two_moving_faces_keep_their_ids():
    ids = TrackIds()
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
    ids = TrackIds(hold_s=1.0)
    first = ids.assign([_box(400, 300)], 10.0)[0]
    # Hidden for 0.8 s, reappears a little further along its path.
    for k in range(1, 24):
        assert ids.assign([], 10.0 + k / FPS) == []
    assert ids.assign([_box(430, 305)], 10.8) == [first]
    # Hidden for 1.5 s: a new person, as far as facecast can tell.
    assert ids.assign([], 10.9) == []
    assert ids.assign([_box(430, 305)], 12.4) != [first]


def test_a_newcomer_far_away_gets_a_new_id_while_the_first_is_occluded():
    ids = TrackIds(hold_s=1.0)
    first = ids.assign([_box(200, 200)], 0.0)[0]
    assert ids.assign([], 0.1) == []
    newcomer = ids.assign([_box(1000, 600)], 0.2)[0]
    assert newcomer != first
    # ...and the first face, back where it was, still gets its own id.
    assert sorted(ids.assign([_box(1000, 600), _box(205, 200)], 0.3)) == sorted([newcomer, first])
