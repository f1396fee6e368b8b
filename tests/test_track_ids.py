"""The supervisor's track id allocator (daemon/track_ids.py, Note [Track id blocks]): blocks from 1,
never overlapping, never granted twice, float32-exact, and a loud refusal when the space is used
up."""

import logging

import numpy as np
import pytest

from facecast.daemon.track_ids import TrackIdAllocator
from facecast.shared.transport import messages
from facecast.shared.transport.messages import TRACK_ID_LIMIT, TrackIdsWanted


def test_blocks_start_at_1_and_never_overlap_across_workers():
    allocator = TrackIdAllocator(block_size=100)
    names = ["roi_landmark:cpu:0", "roi_landmark:cpu:1", "roi_landmark:cpu:0"] * 20
    blocks = [allocator.grant(name) for name in names]
    assert blocks[0].start == 1
    ids = [i for block in blocks for i in range(block.start, block.end)]
    assert len(ids) == len(set(ids)) == 100 * len(names)
    assert ids == sorted(ids) == list(range(1, 100 * len(names) + 1))
    assert allocator.granted_by_worker == {"roi_landmark:cpu:0": 4000, "roi_landmark:cpu:1": 2000}


def test_ids_stay_float32_exact_and_the_last_block_is_cut_at_the_limit(caplog):
    # Near the end of the real space: the default limit is 2**24, exact in a float32 channel.
    allocator = TrackIdAllocator(block_size=1000, first_id=TRACK_ID_LIMIT - 2500)
    with caplog.at_level(logging.WARNING, logger="facecast.daemon.track_ids"):
        blocks = [allocator.grant("w") for _ in range(3)]
        assert allocator.grant("w") is None
    assert [b.count for b in blocks] == [1000, 1000, 500]
    last_id = blocks[-1].end - 1
    assert last_id == TRACK_ID_LIMIT - 1
    assert int(np.float32(last_id)) == last_id  # what the LSL channel carries back
    assert allocator.remaining == 0


def test_a_used_up_space_is_refused_loudly_and_never_wraps_around(caplog):
    allocator = TrackIdAllocator(block_size=4, first_id=1, limit=12)
    with caplog.at_level(logging.WARNING, logger="facecast.daemon.track_ids"):
        granted = [allocator.grant("w") for _ in range(3)]
        refusals = [allocator.grant("w") for _ in range(5)]
    assert [(b.start, b.count) for b in granted] == [(1, 4), (5, 4), (9, 3)]  # ids 1..11
    assert refusals == [None] * 5 and allocator.refusals == 5
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, "refusals are logged once a minute, not once each"
    assert "used up" in errors[0].getMessage() and "restarted" in errors[0].getMessage()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "% of the daemon's track ids are granted" in (
        warnings[0].getMessage())


def test_answer_echoes_the_request_id_with_a_block_or_the_reason():
    allocator = TrackIdAllocator(block_size=4, limit=5)
    request = TrackIdsWanted(worker="roi_landmark:cpu:0")
    grant = messages.decode(messages.encode(allocator.answer(request)))
    assert grant.reply_to == request.id and (grant.block.start, grant.block.count) == (1, 4)
    refused = messages.decode(messages.encode(allocator.answer(TrackIdsWanted(worker="x"))))
    assert refused.block is None and "used up" in refused.error


@pytest.mark.parametrize("kwargs, reason", [
    (dict(first_id=0), "1 <= first_id"),
    (dict(limit=TRACK_ID_LIMIT + 1), "float32-exact"),
    (dict(first_id=10, limit=10), "1 <= first_id"),
    (dict(block_size=1), "block_size must be at least 2"),
])
def test_bad_allocator_settings_are_refused_with_the_rule(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        TrackIdAllocator(**kwargs)
