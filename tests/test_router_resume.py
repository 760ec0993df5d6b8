"""The router's stream follower: progress lines kept and dropped, chunks relayed whole and untouched."""

from __future__ import annotations

import orjson

from kvyard.router.resume import StreamFollower

CHUNK_1 = b'data: {"id":"cmpl-1","created":7,"choices":[{"index":0,"text":"Hel","finish_reason":null}]}\n\n'
CHUNK_2 = b'data: {"id":"cmpl-1","created":7,"choices":[{"index":0,"text":"lo","finish_reason":null}]}\n\n'


def test_progress_lines_are_dropped_and_chunks_pass_untouched_even_when_split() -> None:
    follower = StreamFollower.for_request("completion", {"stream": True, "prompt": "x"})
    assert follower is not None
    stream = b": progress 3 11,12\n" + CHUNK_1 + b": progress 5 13\n" + CHUNK_2
    relayed = b"".join(follower.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
    assert relayed == CHUNK_1 + CHUNK_2
    resumed = orjson.loads(follower.upstream_body({"stream": True, "prompt": "x"}))
    assert resumed["stream_progress"] is True
    assert resumed["resume"] == {"token_ids": [11, 12, 13], "sent_chars": 5, "id": "cmpl-1", "created": 7}
    assert follower.resumable


def test_a_half_event_of_a_failed_replica_never_reaches_the_client() -> None:
    follower = StreamFollower()
    assert follower.feed(b": progress 3 11\n" + CHUNK_1 + CHUNK_2[:20]) == CHUNK_1
    follower.start_attempt()
    assert follower.feed(CHUNK_2) == CHUNK_2


def test_the_last_chunk_or_done_ends_what_can_be_resumed() -> None:
    follower = StreamFollower()
    follower.feed(b": progress 5 11 end\n" + CHUNK_1)
    assert follower.answered and not follower.resumable
    done = StreamFollower()
    done.feed(b"data: [DONE]\n\n")
    assert done.ended and not done.resumable


def test_several_choices_or_prompts_are_not_followed() -> None:
    assert StreamFollower.for_request("completion", {"stream": True, "prompt": "x", "n": 2}) is None
    assert StreamFollower.for_request("completion", {"stream": True, "prompt": ["a", "b"]}) is None
    assert StreamFollower.for_request("chat", {"stream": False, "messages": []}) is None
