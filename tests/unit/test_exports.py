"""The oracle's public face: every exported name exists and nothing else leaks (no vLLM)."""

from __future__ import annotations

import differential.oracle as oracle


def test_oracle_exports_exist() -> None:
    assert sorted(oracle.__all__) == sorted(set(oracle.__all__))
    for name in oracle.__all__:
        assert hasattr(oracle, name), name
    public = {n for n in vars(oracle) if n[0].isalpha()} - {"annotations", "core", "state"}
    assert public == set(oracle.__all__)
