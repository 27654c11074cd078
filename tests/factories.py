"""Small scenario factories shared by the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from differential.scenario import (
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    RequestSpec,
    Scenario,
)

ROOT = Path(__file__).resolve().parent.parent
CORPORA = ROOT / "corpora"


def hybrid(
    full_block: int,
    swa_block: int,
    window: int,
    *,
    prefix: int,
    requests: tuple[RequestSpec, ...],
    retention: int | None,
    drafter: DrafterKind = DrafterKind.MTP,
    spec_tokens: int = 3,
    chunk: int = 2048,
    **kwargs: object,
) -> Scenario:
    """A full-attention + one sliding-window scenario, lookahead hashes off."""
    return Scenario(
        kv_cache_groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, full_block),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, swa_block, window),
        ),
        requests=requests,
        shared_prefix_tokens=prefix,
        retention_interval_tokens=retention,
        drafter=Drafter(drafter, 0 if drafter is DrafterKind.NONE else spec_tokens),
        disable_lookahead_block_hashes=bool(kwargs.pop("disable_lookahead_block_hashes", True)),
        prefill_chunk_tokens=chunk,
        **kwargs,  # type: ignore[arg-type]
    )


def triton(
    drafter: DrafterKind = DrafterKind.MTP, *, retention: int | None = 8192, **kwargs: object
) -> Scenario:
    """The Triton seed geometry: SWA 16, full 32, window 1024, 4 x (16384 + 64)."""
    return hybrid(
        32,
        16,
        1024,
        prefix=16384,
        requests=tuple(RequestSpec(16384, 64) for _ in range(4)),
        retention=retention,
        drafter=drafter,
        **kwargs,
    )


def kvfuzz_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the ``kvfuzz`` command line in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "differential.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
    )
