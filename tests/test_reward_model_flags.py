"""The one-line start: `--reward-model PATH_OR_HUB_ID@REV` with `--dtype`, `--max-length`,
`--truncation-side`, `--chat-template` for `serve`, `ray-serve` and `plan`.

`config.build_config` turns the flags into the `[rewards.<name>]` tables a TOML would hold (the
same StackConfig as the file), alone or added to a `--config` file's. From the command line,
`rewardstack serve --reward-model DIR` with no config file answers `/get_reward` with the model's
own transformers forward, saying on stderr which model loads (n of N), that it calibrates, and
when and where it is ready; `plan --reward-model DIR` answers whether it fits before anything loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rewardstack.cli import build_parser
from rewardstack.config import build_config, load_config, reward_model_name, reward_model_tables
from rewardstack.errors import ConfigError
from service_fixtures import free_port
from trainer_fixtures import make_tiny_llama_rm, reference_scores, rewards_config, texts

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_rm(tmp_path_factory.mktemp("flags") / "Tiny-RM.v0.2")


def test_flags_give_the_config_a_toml_table_gives(model: Path, tmp_path: Path) -> None:
    flags = build_config(None, [str(model)], device="cpu", dtype="bfloat16", max_length=64, truncation_side="left",
                         chat_template=False)
    toml = load_config(rewards_config(tmp_path, model, name="Tiny-RM-v0-2", extra=(
        'dtype = "bfloat16"\nmax_length = 64\ntruncation_side = "left"\nchat_template = false')))
    [got], [want] = flags.user_rewards(), toml.user_rewards()
    assert got == want  # name, path, weight, dtype, bound and the scorer's options
    assert got.name == "rewards.Tiny-RM-v0-2" and got.options.truncation_side == "left"
    assert [m.name for m in flags.active_models()] == [got.name]  # no [models] table: the model alone


def test_flags_combine_with_a_config_file(model: Path, tmp_path: Path) -> None:
    path = rewards_config(tmp_path, model, name="helpful", extra="max_length = 32")
    other = make_tiny_llama_rm(tmp_path / "second", seed=3)
    cfg = build_config(path, [str(other)], max_length=48)
    assert {m.name: m.max_length for m in cfg.user_rewards()} == {"rewards.helpful": 48, "rewards.second": 48}
    assert cfg.device == "cpu" and cfg.source == path.resolve()  # the file's device, state and home
    (tmp_path / "helpful").mkdir()
    with pytest.raises(ConfigError, match="rewards.helpful is in"):  # the flag does not replace the file's table
        build_config(path, [str(tmp_path / "helpful")])
    with pytest.raises(ConfigError, match="--dtype.*--reward-model"):
        build_config(None, [], device="cpu", dtype="float16")


def test_names_and_hub_ids() -> None:
    assert reward_model_name("/models/Skywork-Reward-Llama-3.1-8B-v0.2/") == "Skywork-Reward-Llama-3-1-8B-v0-2"
    assert reward_model_name("7b-rm") == "rm-7b-rm"
    tables = reward_model_tables(["org/rm@0123abc", "other/rm@v1"])
    assert tables == {"rm": {"path": "org/rm", "revision": "0123abc"}, "rm-2": {"path": "other/rm", "revision": "v1"}}
    with pytest.raises(ConfigError, match=r"--reward-model.*org/rm@<commit"):
        reward_model_tables(["org/rm"])


def test_serve_ray_serve_and_plan_take_the_same_flags() -> None:
    parser = build_parser()
    for command in ("serve", "ray-serve", "plan"):
        args = parser.parse_args([command, "--reward-model", "a", "--reward-model", "b", "--max-length", "9",
                                  "--truncation-side", "left", "--no-chat-template"])
        assert (args.reward_model, args.max_length, args.truncation_side, args.chat_template) == (
            ["a", "b"], 9, "left", False)


def _cli(*argv: str, **kw: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("REWARDSTACK_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "rewardstack.cli", *argv], env=env, text=True, **kw)


def test_serve_with_only_a_reward_model_answers_get_reward(model: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = _cli("serve", "--reward-model", str(model), "--max-length", "64", "--truncation-side", "left",
                    "--device", "cpu", "--port", str(port), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        end = time.monotonic() + 300
        while "ready on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.2)
        queries = texts(3, seed=4)
        r = httpx.post(f"http://127.0.0.1:{port}/get_reward", json={"query": queries}, timeout=60)
        assert r.status_code == 200, r.text
        # /get_reward tokenizes as OpenRLHF's serve_rm.py does: the query carries its BOS already
        want = reference_scores(model, queries, max_length=64, side="left", add_special_tokens=False)
        assert max(abs(a - b) for a, b in zip(r.json()["rewards"], want)) < 1e-5
    finally:
        proc.terminate()
        proc.wait(120)
    text = log.read_text()
    loading = text.index("loading rewards.Tiny-RM-v0-2 (1 of 1)")
    calibrating = text.index("calibrating 1 model(s)")
    assert loading < calibrating < text.index(f"ready on http://127.0.0.1:{port}"), text


def test_plan_answers_before_anything_loads(model: Path) -> None:
    def plan(memory: str) -> str:
        proc = _cli("plan", "--reward-model", str(model), "--device-memory", memory, "--max-length", "128",
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        return out

    fits = plan("80GiB")
    assert "rewards.Tiny-RM-v0-2" in fits and "verdict: fits" in fits
    assert " 128 " in next(line for line in fits.splitlines() if line.startswith("rewards.Tiny-RM-v0-2"))
    assert "verdict: cannot fit" in plan("1MiB")
