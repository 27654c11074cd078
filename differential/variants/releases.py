"""Release variants: ``release:X.Y.Z`` runs that vLLM release's wheel as a tree.

The first use fetches the release's wheel, without dependencies, through the
package index the user's pip is configured for (``pip download --no-deps
--only-binary :all: vllm==X.Y.Z -d CACHE``) and unpacks its ``vllm`` package
into ``CACHE/X.Y.Z/vllm``, leaving out the compiled extensions (``*.so``:
CUDA kernels the CPU-only driver never loads). Later uses, and offline use,
take the cache as it is: a cache folder that already holds
``X.Y.Z/vllm/__init__.py`` or a ``vllm-X.Y.Z-*.whl`` needs no network.

The cache folder is ``$KVFUZZ_RELEASE_CACHE``, else
``$XDG_CACHE_HOME/kvfuzz/releases``, else ``~/.cache/kvfuzz/releases``.

Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from differential.errors import VariantError

__all__ = ["CACHE_ENV", "cache_dir", "release_tree"]

CACHE_ENV = "KVFUZZ_RELEASE_CACHE"
_VERSION = re.compile(r"\d+\.\d+\.\d+(?:(?:rc|\.post)\d+)?")


def cache_dir() -> Path:
    """The folder release wheels and unpacked trees are cached in."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvfuzz" / "releases"


def _wheel(cache: Path, version: str) -> Path | None:
    wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    return wheels[0] if wheels else None


def _download(cache: Path, version: str) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--quiet", f"vllm=={version}", "-d", str(cache),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = _wheel(cache, version)
    if done.returncode != 0 or wheel is None:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1][:300] if lines else f"pip exited with status {done.returncode}"
        raise VariantError(
            f"release:{version}: cannot fetch the vllm=={version} wheel ({reason}); "
            f"allowed: a release on the configured package index, or a cache folder "
            f"({CACHE_ENV}={cache}) that already holds vllm-{version}-*.whl or "
            f"{version}/vllm/"
        )
    return wheel


def _unpack(wheel: Path, target: Path) -> None:
    """Unpack the wheel's ``vllm`` package (no ``*.so``) into ``target/vllm``, atomically."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [
                name
                for name in archive.namelist()
                if name.startswith("vllm/") and not name.endswith(".so")
            ]
            if "vllm/__init__.py" not in members:
                raise VariantError(f"{wheel}: holds no vllm/__init__.py; allowed: a vLLM wheel")
            archive.extractall(scratch, members)
        try:
            scratch.rename(target)
        except OSError:
            if not (target / "vllm" / "__init__.py").is_file():
                raise  # not a concurrent unpack that won the race
    except zipfile.BadZipFile as exc:
        raise VariantError(
            f"{wheel}: not a readable wheel ({exc}); delete it to fetch again"
        ) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def release_tree(version: str) -> Path:
    """The folder holding release ``version``'s ``vllm`` package, fetched once.

    Args:
        version: a vLLM release number, e.g. ``0.32.0``.

    Raises:
        VariantError: a malformed version, or a release that is neither cached
            nor downloadable.
    """
    if not _VERSION.fullmatch(version):
        raise VariantError(
            f"--variants: release:{version[:40]!r} is invalid: allowed release:X.Y.Z, "
            "a vLLM release number such as release:0.32.0"
        )
    cache = cache_dir()
    target = cache / version
    if (target / "vllm" / "__init__.py").is_file():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VariantError(
            f"{CACHE_ENV}={cache}: cannot create the release cache ({exc.strerror}); "
            "allowed: a writable folder"
        ) from None
    wheel = _wheel(cache, version) or _download(cache, version)
    _unpack(wheel, target)
    return target
