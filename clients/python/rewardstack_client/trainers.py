"""Reward functions for RLHF trainers that call `rewardstack serve` (httpx only, Python 3.8+).

    from rewardstack_client.trainers import RewardFunction, compute_score

- TRL: `GRPOTrainer(..., reward_funcs=[RewardFunction("http://127.0.0.1:8000")])`; a reward
  function `(prompts, completions, **kwargs) -> list[float]`. Plain-text prompts and completions
  are scored as `prompt + completion`; conversational ones (lists of messages) as the chat
  `prompt + completion`, rendered by the reward model's own chat template on the server.
- verl: `custom_reward_function.path=<this file>`, `custom_reward_function.name=compute_score`;
  `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float`. The service's
  address comes from `$REWARDSTACK_URL` (default http://127.0.0.1:8000) or the `url` keyword
  (verl's `custom_reward_function.reward_kwargs`). The prompt, when `extra_info` carries one
  (`extra_info["prompt"]`: a string or a list of messages), is scored with the response.

Both send vLLM's `POST /classify` body with `use_activation: false`: the scores are the reward
model's raw outputs, as a local `AutoModelForSequenceClassification` would give.

`RewardFunction` splits a call into requests the service accepts: it reads the service's limits
once (`GET /v1/models`: inputs per request, characters per input, characters in all, counted as
the service counts them) and sends as few requests as they allow, so a batch the service could
take in pieces never fails with a 413. Both resend a request the service answers 429 (queue full)
or 503 (loading, draining) after its `Retry-After`, until the retry policy's deadline (300 s by
default), then raise `ServiceUnavailable`; any other refusal raises `ServiceCallError`.
"""

import os
from typing import Any, Dict, Iterator, List, Optional, Sequence

import httpx

from rewardstack_client._client import TOKEN_ENV
from rewardstack_client._errors import ServiceCallError
from rewardstack_client._retry import Attempts, RetryPolicy, pause

URL_ENV = "REWARDSTACK_URL"
"""The service's base URL when none is given (verl's `compute_score` has no other way to learn it)."""
DEFAULT_LIMITS = {"max_inputs": 256, "max_chars": 65536, "max_work_chars": 1024 ** 2}
"""The service's default limits, for a service whose `/v1/models` does not list its own."""


def _headers(token: Optional[str]) -> Dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"Authorization": "Bearer " + token} if token else {}


def _policy(retry: Optional[RetryPolicy]) -> RetryPolicy:
    return retry if retry is not None else RetryPolicy(deadline_s=300.0)


def _classify(client: httpx.Client, body: Dict[str, Any], policy: RetryPolicy) -> List[float]:
    """POST /classify, resent on 429/503 (and a lost connection: scoring is stateless) until the deadline."""
    attempts = Attempts(policy, client.timeout, str(client.base_url), "POST", "/classify", None)
    while True:
        try:
            r = client.post("/classify", json=body, timeout=attempts.try_timeout())
        except httpx.TransportError as e:
            pause(attempts.after_error(e))
            continue
        wait = attempts.after_response(r)
        if wait is None:
            break
        pause(wait)
    if r.status_code != 200:
        raise ServiceCallError.from_response(r)
    return [float(d["probs"][0]) for d in r.json()["data"]]


def size(item: Any) -> int:
    """The characters an input makes the service read, as its limits count them: a text's length, or
    every string of a chat (keys and values: a role counts as much as a content)."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, dict):
        return sum(len(str(k)) + size(v) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return sum(size(v) for v in item)
    return 0


def split(items: Sequence[Any], limits: Dict[str, int], models: int = 1) -> Iterator[range]:
    """The ranges of `items` to send as one request each: as long as the limits allow (inputs per
    request, characters in all over `models` models). ValueError for an input no request can hold."""
    start, work = 0, 0
    for i, item in enumerate(items):
        n = size(item)
        if n > limits["max_chars"] or n * models > limits["max_work_chars"]:
            raise ValueError("input %d has %d characters: more than the service takes in one input (max_chars %d, "
                             "max_work_chars %d over %d model(s))" % (i, n, limits["max_chars"], limits["max_work_chars"],
                                                                     models))
        if i > start and (i - start >= limits["max_inputs"] or (work + n) * models > limits["max_work_chars"]):
            yield range(start, i)
            start, work = i, 0
        work += n
    if start < len(items):
        yield range(start, len(items))


class RewardFunction:
    """A TRL reward function scoring with the service's reward model(s) (`model`: one of them)."""

    def __init__(self, url: Optional[str] = None, *, model: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 180.0, retry: Optional[RetryPolicy] = None) -> None:
        self.model = model
        self.retry = _policy(retry)
        self.requests = 0
        """`/classify` requests answered (a call sends as few as the service's limits allow)."""
        self.__name__ = "rewardstack" + ("_" + model if model else "")  # TRL logs each reward under its name
        self._client = httpx.Client(base_url=url or os.environ.get(URL_ENV, "http://127.0.0.1:8000"),
                                    headers=_headers(token), timeout=timeout)
        self._limits: Optional[Dict[str, int]] = None
        self._models = 1

    def limits(self) -> Dict[str, int]:
        """The service's limits on one request (read once, from `GET /v1/models`)."""
        if self._limits is None:
            r = self._client.get("/v1/models")
            if r.status_code != 200:
                raise ServiceCallError.from_response(r)
            entries = [m for m in r.json()["data"]
                       if self.model is None or self.model in (m["id"], "rewards." + m["id"], m.get("root"))]
            found = [m["limits"] for m in entries if isinstance(m.get("limits"), dict)]
            self._limits = {k: min(f[k] for f in found) for k in DEFAULT_LIMITS} if found else dict(DEFAULT_LIMITS)
            self._models = max(1, len(entries)) if self.model is None else 1  # no model named: each input read by all
        return self._limits

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> List[float]:
        if len(prompts) != len(completions):
            raise ValueError("%d prompts for %d completions" % (len(prompts), len(completions)))
        chat = bool(completions) and not isinstance(completions[0], str)
        items = [list(p) + list(c) if chat else p + c for p, c in zip(prompts, completions)]
        limits = self.limits()
        out: List[float] = []
        for part in split(items, limits, self._models):
            body: Dict[str, Any] = {"messages" if chat else "input": items[part.start:part.stop], "use_activation": False}
            if self.model:
                body["model"] = self.model
            out += _classify(self._client, body, self.retry)
            self.requests += 1
        return out

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Optional[Dict[str, Any]] = None,
                  *, url: Optional[str] = None, model: Optional[str] = None, token: Optional[str] = None,
                  timeout: float = 180.0, retry: Optional[RetryPolicy] = None) -> float:
    """verl's custom reward function: the response (after its prompt, when `extra_info` has one), scored."""
    prompt = (extra_info or {}).get("prompt")
    if isinstance(prompt, list):
        body: Dict[str, Any] = {"messages": list(prompt) + [{"role": "assistant", "content": solution_str}]}
    else:
        body = {"input": (prompt or "") + solution_str}
    body["use_activation"] = False
    if model:
        body["model"] = model
    with httpx.Client(base_url=url or os.environ.get(URL_ENV, "http://127.0.0.1:8000"), headers=_headers(token),
                      timeout=timeout) as client:
        return _classify(client, body, _policy(retry))[0]
