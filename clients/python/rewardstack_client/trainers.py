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
"""

import os
from typing import Any, Dict, List, Optional, Sequence

import httpx

from rewardstack_client._client import TOKEN_ENV

URL_ENV = "REWARDSTACK_URL"
"""The service's base URL when none is given (verl's `compute_score` has no other way to learn it)."""


def _headers(token: Optional[str]) -> Dict[str, str]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"Authorization": "Bearer " + token} if token else {}


def _classify(client: httpx.Client, body: Dict[str, Any]) -> List[float]:
    r = client.post("/classify", json=body)
    if r.status_code != 200:
        raise RuntimeError("rewardstack /classify answered %d: %s" % (r.status_code, r.text[:500]))
    return [float(d["probs"][0]) for d in r.json()["data"]]


class RewardFunction:
    """A TRL reward function scoring with the service's reward model(s) (`model`: one of them)."""

    def __init__(self, url: Optional[str] = None, *, model: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 180.0, chunk: int = 256) -> None:
        self.model = model
        self.chunk = chunk  # the service's max_completions is 256 by default
        self.__name__ = "rewardstack" + ("_" + model if model else "")  # TRL logs each reward under its name
        self._client = httpx.Client(base_url=url or os.environ.get(URL_ENV, "http://127.0.0.1:8000"),
                                    headers=_headers(token), timeout=timeout)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> List[float]:
        if len(prompts) != len(completions):
            raise ValueError("%d prompts for %d completions" % (len(prompts), len(completions)))
        chat = bool(completions) and not isinstance(completions[0], str)
        items = [list(p) + list(c) if chat else p + c for p, c in zip(prompts, completions)]
        out: List[float] = []
        for k in range(0, len(items), self.chunk):
            body: Dict[str, Any] = {"messages" if chat else "input": items[k:k + self.chunk], "use_activation": False}
            if self.model:
                body["model"] = self.model
            out += _classify(self._client, body)
        return out

    def close(self) -> None:
        self._client.close()


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Optional[Dict[str, Any]] = None,
                  *, url: Optional[str] = None, model: Optional[str] = None, token: Optional[str] = None,
                  timeout: float = 180.0) -> float:
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
        return _classify(client, body)[0]
