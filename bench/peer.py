"""The peer rewardstack is measured against: OpenRLHF's own `serve_rm.py`, run as its `__main__`.

`bench/peer_openrlhf/` holds `openrlhf/cli/serve_rm.py` and what it imports (`openrlhf.utils`'s
`get_tokenizer`, `config.hierarchize`, `logging_utils`) from the OpenRLHF repository at commit
3c3be623 (`SOURCE_COMMIT`), each file verbatim below a three-line header naming the repository,
commit, path and upstream git blob; `vendored_blobs()` recomputes every body's git blob id so a
test can hold them to the header. Two files differ, shown in `bench/peer_openrlhf/CHANGES.diff`:
`openrlhf/utils/__init__.py` leaves out the math-grading import (sympy, pylatexenc; never called by
serve_rm), and `openrlhf/models/__init__.py` is replaced by a loader that reads the same folder
with transformers' `AutoModelForSequenceClassification` in float32 (serve_rm's `param_dtype`,
bf16 by default, is not used) and returns the first logit at each row's last attended token, as
OpenRLHF's `RewardModel` does.

`start_serve_rm(model_dir, port)` starts it as a subprocess (`python -m openrlhf.cli.serve_rm`,
uvicorn, `--data.max_len` 512, one torch thread through `OMP_NUM_THREADS=1`); `wait_ready`
waits for its FastAPI schema route (serve_rm has no health route); `get_rewards` posts one
`/get_reward` request as OpenRLHF's executor does (`{"query": [...]}`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

VENDORED = Path(__file__).resolve().parent / "peer_openrlhf"
SOURCE_REPO = "https://github.com/OpenRLHF/OpenRLHF"
SOURCE_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"
MAX_LEN = 512


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a server about to start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_env(threads: int = 1) -> dict[str, str]:
    """This process's environment with every math library held to `threads` threads."""
    n = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n,
            "TOKENIZERS_PARALLELISM": "false"}


def start_serve_rm(model_dir: Path, port: int, *, log: IO[bytes] | None = None, threads: int = 1,
                   max_len: int = MAX_LEN) -> subprocess.Popen:
    """OpenRLHF's serve_rm.py on 127.0.0.1:`port` serving `model_dir` (its output to `log`)."""
    env = thread_env(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(VENDORED), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "openrlhf.cli.serve_rm", "--reward.model_name_or_path", str(model_dir),
           "--data.max_len", str(max_len), "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Return once the server at `url` answers; `RuntimeError` if its process exits first."""
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"serve_rm.py exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/openapi.json", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"serve_rm.py not ready at {url} after {timeout:.0f} s")


def get_rewards(url: str, texts: list[str], timeout: float = 600.0) -> list[float]:
    """One `/get_reward` request of `texts`; the `rewards` list."""
    import httpx

    r = httpx.post(url + "/get_reward", json={"query": texts}, timeout=timeout)
    r.raise_for_status()
    return [float(x) for x in r.json()["rewards"]]


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server and wait for it (killed after 30 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def vendored_blobs() -> dict[str, tuple[str, str]]:
    """Per vendored file: (the git blob its header names, the git blob of its body below the header);
    equal for every file copied verbatim, absent for the two changed ones (no "git blob" header)."""
    out = {}
    for path in sorted(VENDORED.rglob("*.py")):
        text = path.read_bytes()
        head, _, body = text.partition(b"\n# ---\n")
        marker = b"(git blob "
        if b"everything below this header is that file, unchanged" not in head:
            continue
        named = head.split(marker, 1)[1].split(b")", 1)[0].decode()
        actual = hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()
        out[path.relative_to(VENDORED).as_posix()] = (named, actual)
    return out
