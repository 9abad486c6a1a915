"""Episode capture: every call answered under an episode's URL prefix, recorded exactly as the sampler made it.

`Episodes` is the endpoint's register of open episodes: `open(episode_id, root_url)` returns an `EpisodeCapture`
whose `base_url` is the episode's prefix (`<root_url>/episodes/<episode_id>`); `resolve(path)` finds the episode a
request path names (404 for one that is not open); `close(episode_id)` ends it. Every sampled choice of a request
answered under the prefix is one `CapturedCall` (the exact prompt ids, the sampled ids, the sampler's logprobs,
finish reason, policy step), kept in the order the requests arrived (`seq`, taken when a request is routed), until
the episode is closed; a closed episode's prefix is gone (404).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from pipeline.environments.base import Completion
from pipeline.environments.endpoint.errors import EndpointError

UNKNOWN_POLICY_STEP = -1
"""`CapturedCall.policy_step` when neither the endpoint nor the context knows the policy step."""
EPISODES_PREFIX = "/episodes/"


@dataclasses.dataclass
class CapturedCall:
    """One sampled choice of one request: the exact prompt ids, the sampled ids (a stop token kept), the sampler's
    logprobs of them, why sampling ended ("stop" | "length") and the policy step that sampled them."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_step: int
    route: str = ""
    """The route that served it ("generate", "completions", "chat")."""
    request_id: str = ""


def captured_calls(
    prompt: Sequence[int], completions: Sequence[Completion], step: int, route: str, request_id: str
) -> list[CapturedCall]:
    """One `CapturedCall` per choice of a request, ids and logprobs copied as plain ints and floats."""
    return [
        CapturedCall(
            [int(t) for t in prompt],
            [int(t) for t in c.tokens],
            [float(x) for x in c.logprobs],
            c.finish_reason,
            step,
            route,
            request_id,
        )
        for c in completions
    ]


class EpisodeCapture:
    """The calls of one episode (see the module docstring). `base_url` is the episode's root URL; an OpenAI client
    uses `openai_base_url` (`base_url + "/v1"`)."""

    def __init__(self, episodes: Episodes, root_url: str, episode_id: str) -> None:
        self.episode_id = episode_id
        self.base_url = f"{root_url}{EPISODES_PREFIX}{episode_id}"
        self.openai_base_url = f"{self.base_url}/v1"
        self._episodes = episodes
        self._calls: list[tuple[int, int, CapturedCall]] = []
        self._lock = threading.Lock()
        self.closed = False

    def add(self, seq: int, calls: Sequence[CapturedCall]) -> None:
        """Record the choices of the request routed `seq`-th (requests may finish out of order)."""
        with self._lock:
            self._calls += [(seq, i, c) for i, c in enumerate(calls)]

    @property
    def calls(self) -> list[CapturedCall]:
        """The captured calls so far, in the order their requests arrived (choices of one request in order)."""
        with self._lock:
            return [c for _, _, c in sorted(self._calls, key=lambda t: (t[0], t[1]))]

    def close(self) -> list[CapturedCall]:
        """Stop capturing (later requests under this prefix get 404) and return the calls."""
        return self._episodes.close(self.episode_id)


class Episodes:
    """The open episodes of one endpoint (thread-safe)."""

    def __init__(self) -> None:
        self._open: dict[str, EpisodeCapture] = {}
        self._lock = threading.Lock()

    def open(self, episode_id: str, root_url: str) -> EpisodeCapture:
        """Start capturing under `<root_url>/episodes/<episode_id>` (ValueError for a bad or open id)."""
        if not episode_id or any(c in episode_id for c in "/?# "):
            raise ValueError(f"episode_id={episode_id!r}: must be non-empty without '/', '?', '#' or spaces")
        with self._lock:
            if episode_id in self._open:
                raise ValueError(f"episode {episode_id!r} is already open")
            cap = EpisodeCapture(self, root_url, episode_id)
            self._open[episode_id] = cap
        return cap

    def close(self, episode_id: str) -> list[CapturedCall]:
        """Stop capturing `episode_id` and return its calls in arrival order (KeyError if it is not open)."""
        with self._lock:
            cap = self._open.pop(episode_id)
        cap.closed = True
        return cap.calls

    def resolve(self, path: str) -> tuple[EpisodeCapture | None, str]:
        """(the open episode `path` is under, or None; the path below the episode's prefix). Raises EndpointError
        404 for a path under the prefix of an episode that is not open."""
        if not path.startswith(EPISODES_PREFIX):
            return None, path
        episode_id, _, rest = path[len(EPISODES_PREFIX) :].partition("/")
        with self._lock:
            cap = self._open.get(episode_id)
        if cap is None:
            raise EndpointError(404, f"episode {episode_id!r} is not open on this endpoint", "episode_id")
        return cap, "/" + rest
