"""Hypothesis settings profiles for kvfuzz's property tests.

* ``local`` (default on a workstation): 200 examples, random, database on.
* ``ci``: 60 examples, derandomized (same examples every run), no deadline,
  no database, so CI is bounded and never flaky.
* ``nightly``: 5000 examples, random, database on.

Select with ``KVFUZZ_PROFILE=ci|local|nightly``; when unset, ``ci`` is used
if the ``CI`` environment variable is set, ``local`` otherwise.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

__all__ = ["PROFILES", "load_profile"]

_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

PROFILES: dict[str, settings] = {
    "local": settings(max_examples=200, **_COMMON),
    "ci": settings(max_examples=60, derandomize=True, database=None, print_blob=True, **_COMMON),
    "nightly": settings(max_examples=5000, **_COMMON),
}

for _name, _profile in PROFILES.items():
    settings.register_profile(f"kvfuzz-{_name}", _profile)


def load_profile(name: str | None = None) -> str:
    """Load a profile by name (default: from the environment); return its name.

    Raises:
        ValueError: an unknown profile name, naming the allowed ones.
    """
    name = name or os.environ.get("KVFUZZ_PROFILE") or ("ci" if os.environ.get("CI") else "local")
    if name not in PROFILES:
        raise ValueError(f"KVFUZZ_PROFILE={name!r}: allowed {', '.join(PROFILES)}")
    settings.load_profile(f"kvfuzz-{name}")
    return name
