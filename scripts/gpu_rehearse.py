"""Rehearse the GPU check on CPU with only the packages of the GPU machine's image.

The lent GPU machine reaches no registry: scripts/gpu-check.sh must start there with what its image
holds (scripts/gpu-image-packages.txt) and the wheels carried to it (scripts/gpu-carry.txt,
fetched into .whl/ by scripts/gpu-wheels.sh). This builds a site folder that exposes, from the current
environment, only the distributions on that list (symbolic links, nothing copied), and a `python`
wrapper that runs without the environment's own site-packages (`-S`) and with that folder alone;
then the check runs through it in the image mode, with pip barred from any index. A module of the
check that imports a package the image lacks fails here, on CPU, instead of on the card.

    python scripts/gpu_rehearse.py [--drop NAME ...] [--no-carry] [--card] [-- ARGS for gpu-check.sh]

`--card` rehearses the card run (`gpu-check.sh card --rehearse`): every step of scripts/gpu_card.py
on CPU with tiny dimensions, and the CUDA tests it starts with (skipped here).
tests/test_gpu_rehearsal.py runs both in CI.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "scripts" / "gpu-image-packages.txt"
CARRIED = ROOT / "scripts" / "gpu-carry.txt"


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = PACKAGES) -> set[str]:
    """The distributions the GPU machine's image holds."""
    return {canonical(line.strip()) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def carried_packages(path: Path = CARRIED) -> set[str]:
    """The distributions the check needs that the image lacks: carried to the card as wheels in .whl/
    (scripts/gpu-wheels.sh fetches them)."""
    return image_packages(path)


def own_requirements() -> set[str]:
    """rewardstack's own core requirements (no extras), by name."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in md.distribution("rewardstack").requires or []]
    return {canonical(r.name) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})}


def with_requirements(names: set[str], withhold: set[str] = frozenset()) -> set[str]:
    """`names` and, transitively, what the installed versions of them require (extras aside): the
    image holds a consistent set for its own versions, which may need other packages than ours.
    What is in `withhold` never comes in that way: a requirement of our own that the image lacks
    must be carried, even where a local version of an image package happens to require it."""
    from packaging.requirements import Requirement

    have = {canonical(d.metadata["Name"] or ""): d for d in md.distributions()}
    out, todo = set(), [n for n in names if n in have]
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        for r in have[n].requires or []:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = canonical(req.name)
            if dep in have and dep not in out and dep not in withhold:
                todo.append(dep)
    return out


def _entries(dist: md.Distribution) -> set[tuple[str, ...]]:
    """A distribution's files in site-packages as (top,) or (top, child) paths (no scripts, no .pth)."""
    out: set[tuple[str, ...]] = set()
    for f in dist.files or []:
        parts = Path(str(f)).parts
        if not parts or parts[0] == ".." or parts[0].endswith(".pth") or parts[0] == "__pycache__":
            continue
        out.add(tuple(parts[:2]))
    return out


def build_site(dest: Path, allowed: set[str]) -> list[str]:
    """Link every allowed distribution's top-level entries into `dest`; where a top-level folder is
    shared with a distribution that is not allowed (a namespace package such as google/), link its
    children one by one. Returns the distributions linked."""
    dest.mkdir(parents=True, exist_ok=True)
    mine: dict[str, set[tuple[str, ...]]] = {}
    others: set[str] = set()
    roots: dict[str, Path] = {}
    for dist in md.distributions():
        name = canonical(dist.metadata["Name"] or "")
        entries = _entries(dist)
        if name in allowed and name not in mine:
            mine[name] = entries
            roots[name] = Path(str(dist.locate_file("")))
        else:
            others |= {e[0] for e in entries}
    for name, entries in mine.items():
        for e in entries:
            top = e[0]
            target = dest / top
            if top in others and len(e) == 2 and (roots[name] / top).is_dir():
                target.mkdir(exist_ok=True)
                target, src = target / e[1], roots[name] / top / e[1]
            else:
                src = roots[name] / top
            if not target.exists() and not target.is_symlink() and src.exists():
                target.symlink_to(src)
    return sorted(mine)


def make_python(folder: Path, site: Path) -> Path:
    """A `python` that sees the standard library, `site` and PYTHONPATH, and nothing else."""
    exe = folder / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec "{sys.executable}" -S "$@"\n')
    exe.chmod(0o755)
    return exe


def image_site(dest: Path, *, drop: set[str] = frozenset(), carry: bool = True) -> list[str]:
    """The site folder of the card: the image's packages, the carried wheels' (unless `carry` is
    false) and what those need, minus `drop`."""
    dropped = {canonical(d) for d in drop}
    given = image_packages() | (carried_packages() if carry else set())
    withhold = (own_requirements() - given) | dropped
    return build_site(dest, with_requirements(given - dropped, withhold) - dropped)


def rehearse(args: list[str], *, drop: set[str] = frozenset(), carry: bool = True, workdir: Path | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run scripts/gpu-check.sh in the image mode through a python of the image's packages (and the
    carried wheels') only."""
    work = Path(workdir or tempfile.mkdtemp(prefix="gpu-rehearsal-"))
    site = work / "site"
    image_site(site, drop=drop, carry=carry)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHON=str(make_python(work, site)), REWARDSTACK_GPU_CHECK_MODE="image", PIP_NO_INDEX="1",
               PIP_CONFIG_FILE=os.devnull, OUT=str(work / "out"), CUDA_VISIBLE_DEVICES="", HOME=str(work),
               GPU_CHECK_WHEELS=str(work / "no-wheels"))
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drop", action="append", default=[], help="leave this image package out (to see the check name it)")
    ap.add_argument("--no-carry", action="store_true", help="without the wheels of scripts/gpu-carry.txt")
    ap.add_argument("--card", action="store_true", help="the card run: gpu-check.sh card --rehearse")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for gpu-check.sh (after --)")
    a = ap.parse_args()
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    rest = ["card", "--rehearse", *rest] if a.card else rest
    done = rehearse(rest, drop=set(a.drop), carry=not a.no_carry)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
