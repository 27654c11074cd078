"""Skip (or, under KVFUZZ_REQUIRE_VLLM=1, refuse) vLLM tests without vLLM, and
engine tests without the engine environment (KVFUZZ_REQUIRE_ENGINE=1 refuses);
the ``forked_tree_workers`` fixture."""

from __future__ import annotations

import importlib.util
import os

import pytest

from differential import forkserver
from tests.factories import forkserver_address

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _engine_missing() -> str | None:
    """Why the engine environment is unusable, or ``None`` when it is set up."""
    from differential.variants.engine import EngineUnavailable, engine_python

    try:
        engine_python()
    except EngineUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture
def forked_tree_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tree workers started in this test process are forked from the tests'
    fork server (``KVFUZZ_FORKSERVER``), as the command line's are under
    ``kvfuzz_cli`` and as ``kvfuzz mutate`` forks its own: about 1 CPU-second
    a worker instead of 7. Tests without it start fresh interpreters
    (test_releases' in-process runs, the hostile-environment tests)."""
    address = forkserver_address()
    if address is not None:
        monkeypatch.setenv(forkserver.ENV, address)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("engine" in item.keywords for item in items):
        missing = _engine_missing()
        if missing is not None:
            if os.environ.get("KVFUZZ_REQUIRE_ENGINE") == "1":
                raise pytest.UsageError(f"KVFUZZ_REQUIRE_ENGINE=1 but {missing}")
            skip_engine = pytest.mark.skip(reason=missing)
            for item in items:
                if "engine" in item.keywords:
                    item.add_marker(skip_engine)
    if HAVE_VLLM:
        return
    if os.environ.get("KVFUZZ_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("KVFUZZ_REQUIRE_VLLM=1 but vLLM is not importable")
    skip = pytest.mark.skip(reason="vLLM is not installed")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
