"""Preflight of the GPU check: can this python run scripts/gpu_check.py, with nothing installed?

Run by scripts/gpu-check.sh before the check itself. The GPU machine reaches no package registry, so
every import the check needs must already be on its image (scripts/gpu-image-packages.txt) or be
carried as wheels in `.whl/`. This prints one line per needed import with its version, then imports
the check's own modules (scripts/gpu_check.py and the rewardstack modules it loads lazily); it stops
with one list of what is missing, naming the wheels to carry, and exit status 3. Standard library
only until the imports it checks, so a missing package can never end in a traceback here.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
import sys
from pathlib import Path

# (module to import, distribution that provides it): what rewardstack's core and the check import.
NEEDED: list[tuple[str, str]] = [
    ("torch", "torch"),
    ("numpy", "numpy"),
    ("transformers", "transformers"),
    ("safetensors", "safetensors"),
    ("tokenizers", "tokenizers"),
    ("huggingface_hub", "huggingface-hub"),
    ("accelerate", "accelerate"),
    ("sentencepiece", "sentencepiece"),
    ("google.protobuf", "protobuf"),
    ("prometheus_client", "prometheus-client"),
    ("tqdm", "tqdm"),
    ("pydantic", "pydantic"),  # the step's wire schema; the card's image lacks it (scripts/gpu-carry.txt)
]
MISSING_EXIT = 3
HERE = Path(__file__).resolve().parent


def version_of(dist: str) -> str:
    """The installed version of a distribution, or '?' when it has no metadata (a bare folder)."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "?"


def download_command(dists: list[str], *, deps: bool) -> str:
    """The `pip download` line that fetches `dists` as wheels for the card's python into .whl/
    (with `deps`, their requirements too, resolved together: scripts/gpu-wheels.sh)."""
    return (f"python3 -m pip download {'' if deps else '--no-deps '}--only-binary=:all: --python-version 3.12 "
            f"--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "
            f"--platform manylinux2014_x86_64 -d .whl {' '.join(dists)}")


def wheel_hint(dist: str) -> str:
    """The command that fetches `dist` as a wheel for the card's python (docs/GPU.md explains)."""
    return download_command([dist], deps=False)


def missing_distribution(err: ImportError) -> str:
    """The distribution to carry for a failed import (the top-level module's name, as pip spells it)."""
    top = (getattr(err, "name", None) or str(err)).split(".")[0]
    known = {mod.split(".")[0]: dist for mod, dist in NEEDED}
    return known.get(top, top.replace("_", "-"))


def check_imports() -> list[tuple[str, str]]:
    """Print one line per needed third-party import; return (what failed, distribution) pairs."""
    print(f"python {platform.python_version()} at {sys.executable}", flush=True)
    missing: list[tuple[str, str]] = []
    for mod, dist in NEEDED:
        try:
            m = importlib.import_module(mod)
        except ImportError as err:
            # The module itself, or a package it needs (then that package is the wheel to carry).
            need = dist if (getattr(err, "name", None) or mod).split(".")[0] == mod.split(".")[0] else missing_distribution(err)
            print(f"  [missing] {mod} needs {need}: {err}", flush=True)
            missing.append((mod, need))
            continue
        extra = ""
        if mod == "torch":
            cuda = getattr(m.version, "cuda", None)
            extra = f", CUDA {cuda}" if cuda else ", CPU build"
            if cuda and m.cuda.is_available():
                extra += f", device {m.cuda.get_device_name()}"
        print(f"  {mod} {version_of(dist)}{extra}", flush=True)
    return missing


def check_project() -> list[tuple[str, str]]:
    """Import the check's scripts (gpu_check.py, and gpu_card.py of `gpu-check.sh card`) and every
    module they load lazily; a module that needs a package this python lacks is named with that package."""
    sys.path.insert(0, str(HERE))
    missing: list[tuple[str, str]] = []
    modules = ["rewardstack"]
    for script in ("gpu_check", "gpu_card"):
        try:
            modules += getattr(importlib.import_module(script), "LAZY_MODULES", [])
        except ImportError as err:
            dist = missing_distribution(err)
            print(f"  [missing] scripts/{script}.py needs {dist}: {err}", flush=True)
            return [(script, dist)]
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            dist = missing_distribution(err)
            print(f"  [missing] {name} needs {dist}: {err}", flush=True)
            missing.append((name, dist))
    if not missing:
        print(f"  rewardstack from {Path(sys.modules['rewardstack'].__file__).parent} and {len(modules) - 1} "
              "modules of the check: importable", flush=True)
    return missing


def main() -> int:
    """Exit 0 when the check can start, MISSING_EXIT with the list of wheels to carry otherwise."""
    print("preflight: imports the GPU check needs", flush=True)
    missing = check_imports()
    if not missing:  # the project's imports only mean something once the libraries are there
        missing = check_project()
    if not missing:
        return 0
    dists = sorted({d for _, d in missing})
    print(f"preflight: {len(dists)} package(s) missing from this python: {', '.join(dists)}", flush=True)
    print("  carry them as wheels in .whl/ (name .whl in the run's carry; scripts/gpu-check.sh installs them "
          "with --no-index); fetch each, with its own missing needs, on a machine that has PyPI:", flush=True)
    for d in dists:
        print(f"    {wheel_hint(d)}", flush=True)
    return MISSING_EXIT


if __name__ == "__main__":
    sys.exit(main())
