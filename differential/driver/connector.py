"""A scheduler-side KV connector with an empty remote store, for scheduler mode.

vLLM's bundled ``ExampleConnector`` does not support the hybrid allocator
(``SupportsHMA``), so ``Scheduler.__init__`` refuses it for a model with
several KV cache groups. This connector is loaded by vLLM's own
``KVConnectorFactory`` through ``KVTransferConfig.kv_connector_module_path``
(vllm/distributed/kv_transfer/kv_connector/factory.py), the extension point
for external connectors. Its remote store is always empty: it never reports
external tokens (``get_num_new_matched_tokens`` -> 0), never loads or saves,
and never delays a free. What a configured connector changes in the KV cache
manager (legacy block hashes, ``VllmConfig.num_hash_lookahead_tokens`` = 0)
therefore happens through vLLM's own code, with no transfer to model.

Only the scheduler role is served; the worker-side methods are never called
(no model runs) and raise if they are.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

__all__ = ["EmptyRemoteConnector"]


# vLLM is not type-checked (pyproject.toml), so its base classes are Any here.
class EmptyRemoteConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A KV connector whose remote store holds nothing (scheduler side only)."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """No external tokens, synchronously (tokens: always 0)."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to load."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Empty metadata (nothing to transfer)."""
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """Free at once, nothing sent."""
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """Free at once, nothing sent (hybrid allocator form)."""
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker side: never called (no model runs)."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker side: never called."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        """Worker side: never called."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")

    def wait_for_save(self) -> None:
        """Worker side: never called."""
        raise NotImplementedError("EmptyRemoteConnector serves the scheduler role only")
