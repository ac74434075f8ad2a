"""The full-size memory simulation checked against the real all-mpnet-base-v2, for the first time.

`simulate_peak` builds all-mpnet-base-v2 from its published config (`configs/archs/`, no weights)
on the meta device; here the real checkpoint runs the same scorer pass (encoding.pad_batch, the
model, the mean pooling head; random ids, the last row one token short as in scoring batches) on
CPU under the tensor-bytes tracker, over a grid of (batch, length) up to the 512-token bound. The
two peaks must agree within 5% (docs/MEMORY.md has the table from a wider grid: they agree to the
byte).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from real_fixtures import real_models
from rewardstack._planning import simulate as S
from rewardstack._memory.device import TensorBytesTracker

pytestmark = pytest.mark.real

MODEL = "relevance_filter[1]"  # diversity runs the same pass on the same checkpoint
GRID = [(1, 16), (8, 32), (1, 128), (4, 128), (16, 64), (1, 512), (2, 512)]


def _gpu_check() -> Any:
    """scripts/gpu_check.py: its `scorer_pass` is the pass the simulation stands for."""
    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).parent.parent / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def tracked_peak(model: torch.nn.Module, batch: int, length: int) -> int:
    """Peak tensor bytes above the start of the real checkpoint's scorer pass."""
    tr = TensorBytesTracker()
    with torch.inference_mode(), tr.window("real") as w:
        _gpu_check().scorer_pass(MODEL, (model,), batch, length, 0, "cpu")
    return w.peak_increase


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import AutoModel

    m = AutoModel.from_pretrained(str(real_models().mpnet), dtype=torch.float32)
    return m.eval().requires_grad_(False)


def test_shipped_arch_is_the_checkpoints_config() -> None:
    """The simulation's config is the real one in every field that shapes a tensor."""
    real = json.loads((real_models().mpnet / "config.json").read_text())
    arch = S.load_arch(S.model_path(MODEL))
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "relative_attention_num_buckets", "pad_token_id"):
        assert getattr(arch.config(), key) == real[key], key


@pytest.mark.parametrize("batch,length", GRID)
def test_simulated_peak_matches_the_real_checkpoint(model: torch.nn.Module, batch: int, length: int) -> None:
    sim = S.simulate_peak(MODEL, batch, length, "float32").peak_bytes
    real = tracked_peak(model, batch, length)
    assert real > 0 and abs(sim - real) <= 0.05 * real, (batch, length, sim, real)
