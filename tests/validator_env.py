"""A validator's environment for the client tests: a fresh venv holding torch and httpx and nothing else.

No package index is reachable from the tests, so the venv sees this interpreter's installed torch
and httpx (and what they require) through a folder of symlinks named in a `.pth` file, not a copy;
rewardstack and its other dependencies are not there. `install_client` then installs the client's
wheel (`build_wheel`) into it the way an operator's `pip install ./clients/python` does (no index).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "clients" / "python"


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions `names` need (their unconditional requirements, transitively)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if _key(name) in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional or platform-only requirement this interpreter does not have
        seen[_key(name)] = dist
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
    return seen


def make_env(where: Path, packages: list[str]) -> Path:
    """A venv at `where` seeing only `packages` (and what they require); its python.

    The venv has no pip of its own (ensurepip costs seconds of CPU): `install_client` installs
    with this interpreter's pip, pointed at the venv.
    """
    venv.EnvBuilder(with_pip=False).create(where)
    shelf = where / "shelf"
    shelf.mkdir()
    for dist in closure(packages).values():
        site = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if top.endswith(".pth") or top == "__pycache__" or (shelf / top).exists():
                continue
            if (site / top).exists():
                (shelf / top).symlink_to(site / top)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "validator_shelf.pth").write_text(str(shelf) + "\n")
    return python


def _without_pythonpath() -> dict[str, str]:
    """This environment without PYTHONPATH: the validator's venv must see only what it holds (a
    checkout's source folder on the path would pass for an installed client)."""
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def build_wheel(wheels: Path) -> subprocess.CompletedProcess:
    """clients/python built into a wheel in `wheels` with this interpreter's pip and setuptools."""
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-q", "-w", str(wheels), str(CLIENT)],
                          capture_output=True, text=True)


def install_client(python: Path, wheels: Path) -> subprocess.CompletedProcess:
    """`pip install` of the client's wheel (`build_wheel` made it in `wheels`) into the venv of
    `python`, from no index (httpx must already be there), as an operator's
    `pip install ./clients/python` ends.

    The wheel is built with this interpreter's setuptools (a fresh venv's bundled one would need
    the `wheel` package, which only an index could give); this interpreter's pip installs it into
    the venv (`pip --python VENV_PYTHON install`), checking its requirements against the venv's
    packages.
    """
    wheel = next(wheels.glob("rewardstack_client-*.whl"))
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                           "--disable-pip-version-check", "-q", str(wheel)], capture_output=True, text=True,
                          env=_without_pythonpath())


def versions(python: Path, names: list[str]) -> dict[str, str | None]:
    """The installed version of each distribution in the venv (None when absent)."""
    code = ("import importlib.metadata as md, json, sys\n"
            "out = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try: out[n] = md.version(n)\n"
            "    except md.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    import json

    # Run outside the checkout: `-c` puts the working directory on the path, and a checkout may
    # hold rewardstack's egg-info from an editable install.
    r = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, check=True,
                       cwd=python.parents[2], env=_without_pythonpath())
    return json.loads(r.stdout)


__all__ = ["CLIENT", "ROOT", "build_wheel", "closure", "install_client", "make_env", "versions", "sys"]
