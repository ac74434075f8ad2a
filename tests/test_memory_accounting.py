"""One accounting on every device, and a card of a given size.

CUDA is simulated with an injected device snapshot (free/total from the driver, reserved/allocated
from torch's allocator), the way the real `torch.cuda.mem_get_info` / `memory_allocated` report
them; the arithmetic under test is the same code that runs on a card.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from memory_fixtures import FakeCard
from rewardstack.config import StackConfig
from rewardstack._memory import MemoryManager
from rewardstack._settings import MemorySettings

MiB = 1024**2
GiB = 1024**3


def _mod(nbytes: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(nbytes // 4), requires_grad=False)
    return m


def _cfg(**memory: int) -> StackConfig:
    return StackConfig(gpu_utilization=0.9, headroom_bytes=0, memory=MemorySettings(**memory))


def test_budget_starts_from_free_memory_and_measures_memory_outside_torch() -> None:
    card = FakeCard(total=80 * GiB, free=50 * GiB)  # another process holds 30 GiB
    mm = MemoryManager(None, device="cuda", snapshot=card)
    mm.register_model("m", [_mod(4 * MiB)])
    card.free -= 2 * GiB  # the CUDA context and cuBLAS workspace appeared: not torch's
    b = mm.setup(_cfg())
    assert b.free_at_start == 50 * GiB and b.non_torch_bytes == 2 * GiB
    assert b.activation_bytes == 50 * GiB - 2 * GiB - 4 * MiB  # not 80 x 0.9: the card is shared
    assert "free at start" in b.describe() and "outside torch" in b.describe()


def test_what_torch_held_at_start_counts_as_free() -> None:
    # Torch's cache reserved before the stack started is this process's to reuse: free at start
    # is the driver's free plus torch's reserved (red when the reserved term is dropped).
    card = FakeCard(total=80 * GiB, free=50 * GiB)
    card.reserved = 1 * GiB
    mm = MemoryManager(None, device="cuda", snapshot=card)
    mm.register_model("m", [_mod(4 * MiB)])
    b = mm.setup(_cfg())
    assert b.free_at_start == 51 * GiB and b.non_torch_bytes == 0
    assert b.activation_bytes == 51 * GiB - 4 * MiB


def test_plans_subtract_bytes_live_now_on_cuda() -> None:
    card = FakeCard(total=8 * GiB, free=8 * GiB)
    mm = MemoryManager(None, device="cuda", snapshot=card)
    weights = _mod(4 * MiB)
    mm.register_model("m", [weights])
    mm.setup(_cfg())
    mm.placement.move = False  # the fake card: nothing really moves
    card.allocated = 4 * MiB  # the resident weights
    assert mm.live_bytes() == 0
    card.allocated += 1 * GiB  # a prefix cache kept for the step
    assert mm.live_bytes() == GiB
    from rewardstack._memory.costmodel import CostModel

    mm.set_cost_model("m", CostModel(b=8.0, samples=[(1, 10**9, 8 * 10**9)]))
    before = mm.length_cap("m", 10**9)
    card.allocated += 2 * GiB
    assert mm.length_cap("m", 10**9) < before  # the same arithmetic as the tracker's on CPU


def test_device_memory_makes_a_large_card_behave_as_a_small_one() -> None:
    card = FakeCard(total=141 * GiB, free=140 * GiB)
    mm = MemoryManager(None, device="cuda", snapshot=card)
    mm.register_model("big", [_mod(64 * MiB)])
    mm.register_model("small", [_mod(16 * MiB)])
    b = mm.setup(_cfg(device_memory=40 * GiB))
    assert b.total_bytes == 40 * GiB and b.activation_bytes == int(40 * GiB * 0.9) - 80 * MiB


def test_device_memory_sizes_the_simulated_device_on_cpu() -> None:
    mm = MemoryManager(None)  # CPU: the tracker is the device
    for n in ("a", "b", "c"):
        mm.register_model(n, [_mod(4 * MiB)])
    b = mm.setup(_cfg(device_memory=10 * MiB))
    # 12 MiB of weights on a 10 MiB card: placement keeps some on the host, activations get a share
    assert b.total_bytes == 10 * MiB and mm.tracker.budget_bytes == b.activation_bytes > 0
    assert mm.placement.device_bytes() <= int(10 * MiB * 0.9 * 0.8)
    assert {d.where for d in mm.placement.decisions.values()} - {"resident"}


def test_cli_device_memory_flag_overrides_the_config(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import rewardstack._runner as runner
    from rewardstack import cli

    seen = {}

    class Stop(Exception):
        pass

    def fake_stack(cfg, recalibrate=False):  # noqa: ANN001, ANN202
        seen["device_memory"], seen["recalibrate"] = cfg.memory.device_memory, recalibrate
        raise Stop

    monkeypatch.setattr(runner, "RewardStack", fake_stack)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "s"}"\n[memory]\ndevice_memory = "80GiB"\n')
    try:
        cli.main(["score", "--config", str(cfg), "--input", str(cfg), "--output", "-", "--device-memory", "24GiB", "--recalibrate"])
    except Stop:
        pass
    assert seen == {"device_memory": 24 * GiB, "recalibrate": True}


DAHOAS_LOAD = textwrap.dedent("""
    import json, resource, sys
    import torch
    from rewardstack.config import ModelConfig
    from rewardstack._memory import MemoryManager
    from rewardstack._scorers.base import Runtime
    from rewardstack._scorers.dahoas import load_dahoas
    from rewardstack._scorers.loading import ModelCache
    folder, base = sys.argv[1], sys.argv[2]
    cpu = torch.device("cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = ModelConfig(name="dahoas_reward_model", path=folder, weight=1.0, options={"base_config": base})
    tok, body, head = load_dahoas(cfg, Runtime(device=cpu, memory=MemoryManager(None), models=ModelCache(cpu)))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    nbytes = sum(p.numel() * p.element_size() for p in body.parameters())
    print(json.dumps({"rise": after - before, "params": nbytes}))
""")


def test_dahoas_pt_checkpoint_loads_without_a_second_copy(tmp_path: Path) -> None:
    """A 1 GiB `hf_ckpt.pt` loads with peak RSS rising by at most 1.3x the file (mmap + assign)."""
    from transformers import GPTJConfig

    from rewardstack._standins.tokenizer import DECODER_INPUTS, save_tokenizer

    base = tmp_path / "base"
    base.mkdir()
    tok = save_tokenizer(base, 2048, input_names=DECODER_INPUTS)
    # 19 layers of 4 x 1024^2 attention + 2 x 1024 x 4096 MLP weights, and the embeddings: 1.1 GiB in float32
    conf = GPTJConfig(vocab_size=len(tok), n_embd=1024, n_layer=19, n_head=8, rotary_dim=64, n_positions=2048,
                      n_inner=4096, bos_token_id=0, eos_token_id=0)
    conf.save_pretrained(str(base))
    from accelerate import init_empty_weights
    from transformers import GPTJModel

    with init_empty_weights():
        shapes = {k: (v.shape, v.dtype) for k, v in GPTJModel(conf).state_dict().items()}
    state = {f"transformer.{k}": torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}  # uninitialised: fast
    state["v_head.weight"] = torch.zeros(1, 1024)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    ckpt = folder / "hf_ckpt.pt"
    torch.save(state, str(ckpt))
    del state
    size = ckpt.stat().st_size
    try:
        assert size >= GiB
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
        out = subprocess.run([sys.executable, "-c", DAHOAS_LOAD, str(folder), str(base)], capture_output=True, text=True,
                             env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        import json

        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["params"] >= 0.9 * size
        assert got["rise"] <= 1.3 * size, (got, size)
    finally:
        ckpt.unlink(missing_ok=True)


def test_serve_recalibrate_flag_reaches_the_workers_stack(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import rewardstack._service.worker as worker_mod
    from rewardstack import cli

    seen = {}

    def fake_stack(cfg, load_state=True, recalibrate=False):  # noqa: ANN001, ANN202
        seen["recalibrate"] = recalibrate
        raise RuntimeError("stop after the stack is asked for")

    monkeypatch.setattr(worker_mod, "RewardStack", fake_stack)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "s"}"\n')
    # The worker fails to load (the fake stack), so the server stops by itself with an error.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = cli.main(["serve", "--config", str(cfg), "--port", str(port), "--recalibrate"])
    assert seen == {"recalibrate": True}
    assert code != 0
