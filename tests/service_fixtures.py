"""Helpers for the service tests: a small stand-in config and the real server in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def one_reward_model_toml(state_dir: Path, *, diversity: bool = True, service: str | None = None) -> str:
    """A stand-in config scoring with the RLHF model alone, every other reward at weight 0.

    With `diversity`, the diversity mask runs on the relevance stand-in's MPNet (its split:
    embeddings in the stateless part, history in the stateful one, is what the service depends
    on); `service` is the body of a `[service]` table.
    """
    diversity_table = ('path = "relevance_filter/mpnet"\ndtype = "float32"' if diversity else "enabled = false")
    text = f"""\
device = "cpu"
state_dir = "{state_dir}"

[models.dpo_reward_model]
weight = 0.0
[models.rlhf_reward_model]
path = "rlhf_reward_model"
weight = 1.0
dtype = "float32"
[models.reciprocate_reward_model]
weight = 0.0
[models.relevance_filter]
enabled = false
[models.diversity_reward_model]
{diversity_table}
[models.nsfw_filter]
path = "nsfw_filter"
dtype = "float32"
"""
    return text if service is None else f"{text}\n[service]\n{service}\n"


def write_config(standins: Path, state_dir: Path, tag: str, **service: Any) -> Path:
    """A config beside the stand-ins (their relative paths resolve) with its own state dir."""
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in service.items())
    path = standins / f"service-{tag}.toml"
    # One reward model and every mask but relevance: the service's split state and the blacklist.
    path.write_text(one_reward_model_toml(state_dir, service=lines))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`rewardstack serve` as a subprocess on a loopback port."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.config = config
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.env.pop("REWARDSTACK_TOKEN", None) if env is None or "REWARDSTACK_TOKEN" not in env else None
        self.log = log or config.with_suffix(".log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        self._log = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rewardstack.cli", "serve", "--config", str(self.config), "--port", str(self.port), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
        )
        return self

    def wait_ready(self, timeout: float = 600.0) -> "Server":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready in {timeout}s: {self.log.read_text()[-3000:]}")

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM, then the exit status (killed after `timeout`)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()


def text_steps(tag: str, n: int, width: int = 6) -> list[dict[str, Any]]:
    """`n` validator steps (augment, followup0, answer0, ... ) whose texts are unique to `tag`."""
    names = ["augment", "followup0", "answer0", "followup1", "answer1"]
    steps = []
    for k in range(n):
        comps = [f"{tag} completion {k}-{j}: " + " ".join(f"w{(k * 7 + j * 3 + i) % 23}{tag}" for i in range(3 + j))
                 for j in range(width)]
        comps[1] = comps[0] if k % 3 == 0 else comps[1]  # a repeat: diversity and the blacklist see it
        if k % 4 == 1:
            comps[2] = "That is an excellent question."
        step: dict[str, Any] = {"name": names[k % 5], "prompt": f"{tag} prompt {k}?", "completions": comps}
        if k % 5:
            step["base_prompt"] = f"{tag} base {k // 5}"
        if k % 6 == 5:
            step["failed"] = [j == 3 for j in range(width)]
        steps.append(step)
    return steps


def comparable(event: dict[str, Any]) -> dict[str, Any]:
    """An event without what legitimately differs between runs (time taken, the service's sequence,
    the memory its answer reports)."""
    return {k: v for k, v in event.items() if k not in ("step_length", "sequence", "memory")}
