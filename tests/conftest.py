"""Skip (or, under KVFUZZ_REQUIRE_VLLM=1, refuse) vLLM tests without vLLM."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    if os.environ.get("KVFUZZ_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("KVFUZZ_REQUIRE_VLLM=1 but vLLM is not importable")
    skip = pytest.mark.skip(reason="vLLM is not installed")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
