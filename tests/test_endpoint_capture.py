"""Episode capture of the generate endpoint (pipeline/environments/endpoint/capture.py), alone: the register of open
episodes, the prefix a request path names, and the calls of an episode in the order their requests arrived.

Checked: an episode id must fit in a URL path segment and be open once; a path under an open episode's prefix
resolves to it and the route below, one under an unknown or closed episode is a 404 naming `episode_id`; calls
recorded out of order come back in arrival order (choices of a request in order); closing returns them and closes
the prefix; a completion's ids and logprobs (numpy values included) are captured as plain ints and floats.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.environments.base import Completion
from pipeline.environments.endpoint import CapturedCall, EndpointError
from pipeline.environments.endpoint.capture import Episodes, captured_calls

ROOT = "http://127.0.0.1:9"


def test_episode_ids_and_prefixes() -> None:
    episodes = Episodes()
    for bad in ("", "a/b", "a?b", "a#b", "a b"):
        with pytest.raises(ValueError, match="episode_id"):
            episodes.open(bad, ROOT)
    cap = episodes.open("ep-1", ROOT)
    assert cap.base_url == f"{ROOT}/episodes/ep-1" and cap.openai_base_url == f"{ROOT}/episodes/ep-1/v1"
    with pytest.raises(ValueError, match="already open"):
        episodes.open("ep-1", ROOT)
    assert episodes.resolve("/v1/completions") == (None, "/v1/completions")
    assert episodes.resolve("/episodes/ep-1/v1/completions") == (cap, "/v1/completions")
    assert episodes.resolve("/episodes/ep-1") == (cap, "/")
    with pytest.raises(EndpointError, match="'ep-2' is not open") as e:
        episodes.resolve("/episodes/ep-2/v1/models")
    assert (e.value.status, e.value.param) == (404, "episode_id")


def test_calls_come_back_in_arrival_order_and_close_ends_the_episode() -> None:
    episodes = Episodes()
    cap = episodes.open("ep", ROOT)
    first = captured_calls(
        [1, 2], [Completion([5], [-0.1], "stop"), Completion([6], [-0.2], "length")], 3, "chat", "r1"
    )
    second = captured_calls([1, 2, 5, 9], [Completion([7], [-0.3], "stop")], 4, "generate", "r2")
    cap.add(8, second)  # the later request finished first
    cap.add(2, first)
    assert [(c.request_id, c.completion_ids) for c in cap.calls] == [("r1", [5]), ("r1", [6]), ("r2", [7])]
    calls = cap.close()
    assert calls == cap.calls and cap.closed
    with pytest.raises(EndpointError):
        episodes.resolve("/episodes/ep/v1/completions")
    with pytest.raises(KeyError):
        episodes.close("ep")
    assert episodes.open("ep", ROOT).calls == []  # the id can be used again once closed


def test_captured_calls_are_plain_values() -> None:
    comp = Completion(list(np.array([3, 4], dtype=np.int32)), list(np.array([-0.5, -0.25], dtype=np.float32)), "stop")
    [call] = captured_calls(np.array([1, 2]), [comp], 7, "completions", "r")  # type: ignore[arg-type]
    assert call == CapturedCall([1, 2], [3, 4], [-0.5, -0.25], "stop", 7, "completions", "r")
    assert {type(x) for x in [*call.prompt_ids, *call.completion_ids]} == {int}
    assert {type(x) for x in call.logprobs} == {float}
