"""KV cache groups: their kinds, their validation, which take the EAGLE drop.

Units: lengths ending in ``_tokens`` are tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from differential.errors import ScenarioError

__all__ = ["DraftGroups", "GroupKind", "KVCacheGroup", "MambaPrefill"]


class GroupKind(StrEnum):
    """Attention type of a KV cache group (vLLM ``kv_cache_interface.py``)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    #: A Mamba / linear-attention (GDN, KDA) state group: vLLM's ``MambaSpec``
    #: driven by ``MambaManager`` in ``mamba_cache_mode="align"``, the only
    #: mode with prefix caching (vllm/config/cache.py). One block holds one
    #: state: the recurrent state after exactly the tokens up to its end.
    MAMBA = "mamba"
    #: Multi-head latent attention (DeepSeek-V2/V3/V4): vLLM's
    #: ``MLAAttentionSpec``, a ``FullAttentionSpec`` subclass driven by
    #: ``FullAttentionManager`` (vllm/v1/core/single_type_kv_cache_manager.py
    #: registers it so); for hits it behaves exactly like full attention.
    MLA = "mla"
    #: Sliding-window MLA (DeepSeek-V4's compressed local layers): vLLM's
    #: ``SlidingWindowMLASpec``, a ``SlidingWindowSpec`` subclass driven by
    #: ``SlidingWindowManager``; for hits it behaves like a sliding window.
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    #: Chunked local attention (Llama-4's ``attention_chunk_size`` layers):
    #: vLLM's ``ChunkedLocalAttentionSpec`` driven by
    #: ``ChunkedLocalAttentionManager``: a token attends only to the tokens of
    #: its own chunk, so blocks of earlier chunks are never needed for a hit.
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    #: A circular buffer (the ring of raw keys a KV compressor has not yet
    #: compressed: DeepSeek-V4.1's ``DeepseekCompressor``,
    #: vllm/models/deepseek_v41/compressor.py; GLM-5-next, Step-5, Qwen-4
    #: experimental): vLLM's ``CircularBufferSpec`` driven by
    #: ``CircularBufferManager``. One block per request for its whole life,
    #: never prefix-cacheable (``CircularBufferSpec.prefix_cacheable`` is
    #: false): ``HybridKVCacheCoordinator`` leaves it out of every lookup, so
    #: it hits nothing and bounds no other group's hit. Its block size (the
    #: ring's capacity, in tokens) still enters the scheduler block size
    #: (``resolve_kv_cache_block_sizes`` takes the LCM of every group).
    CIRCULAR_BUFFER = "circular_buffer"
    #: Full attention with static sink KV (openPangu's ``StaticSinkAttention``
    #: with ``param_sink_number > 0``, vllm/model_executor/models/openpangu.py):
    #: vLLM's ``SinkFullAttentionSpec`` (a ``FullAttentionSpec`` with
    #: ``sink_len`` tokens) driven by ``SinkFullAttentionManager``, a
    #: ``FullAttentionManager`` subclass. The sink is learned KV shared by
    #: every request and part of none's prefix: the attention backend
    #: prepends the physical blocks ``1 .. sink_len / block_size`` to every
    #: block table (``create_static_sink_attention_backend``,
    #: vllm/model_executor/layers/attention/static_sink_attention.py), and
    #: vLLM PR #28775 keeps those blocks out of the free list. For hits it
    #: behaves exactly like full attention.
    SINK_FULL_ATTENTION = "sink_full_attention"
    #: Reference sliding-window attention (R-SWA, vLLM PR #46564, Unlimited
    #: OCR): vLLM's ``RSWASpec(rswa_window)``, a ``FullAttentionSpec``
    #: subclass driven by ``RSWAManager`` (a ``FullAttentionManager``;
    #: vllm/v1/core/single_type_kv_cache_manager.py). Prompt tokens stay
    #: visible to every later token, so its hits are full attention's; only
    #: the last ``rswa_window`` decoded tokens are attended, and
    #: ``remove_skipped_blocks(num_prompt_tokens=...)`` frees the decode
    #: blocks between the prompt's last block and that window. The window
    #: rides in ``sliding_window_tokens``.
    RSWA = "rswa"

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the kind's groups take part in prefix caching (vLLM
        ``KVCacheSpec.prefix_cacheable``; false for a circular buffer)."""
        return self is not GroupKind.CIRCULAR_BUFFER

    @property
    def slot_table(self) -> bool:
        """Whether a request's block table in the kind's groups holds a slot
        per token (its length in blocks times the block covers every token
        computed): every attention kind, not a Mamba group (a state per
        block) nor a circular buffer (one ring)."""
        return self not in (GroupKind.MAMBA, GroupKind.CIRCULAR_BUFFER)

    @property
    def full_attention_family(self) -> bool:
        """Driven by vLLM's ``FullAttentionManager`` or a subclass of it (full
        attention, MLA, sink full attention, R-SWA's ``RSWAManager``: the
        coordinators test ``isinstance(spec, FullAttentionSpec)``)."""
        return self in (
            GroupKind.FULL_ATTENTION,
            GroupKind.MLA,
            GroupKind.SINK_FULL_ATTENTION,
            GroupKind.RSWA,
        )

    @property
    def windowed(self) -> bool:
        """Whether the kind's groups carry a window (``sliding_window_tokens``):
        the sliding-window family, and R-SWA's ``rswa_window``."""
        return self.sliding_window_family or self is GroupKind.RSWA

    @property
    def sliding_window_family(self) -> bool:
        """Driven by vLLM's ``SlidingWindowManager`` (sliding window, SW-MLA)."""
        return self in (GroupKind.SLIDING_WINDOW, GroupKind.SLIDING_WINDOW_MLA)


class DraftGroups(StrEnum):
    """Which KV cache groups take the EAGLE block drop, and why.

    ``NONE``: the scenario's drafter never drops (no drafter, or one whose
    draft KV does not read the next token). ``ANNOTATED``: some groups are
    marked ``is_eagle_group`` as vLLM's planner marks the drafter's own KV
    groups (vllm/v1/core/kv_cache_planning.py), and only they (and groups
    sharing their spec, batched together by
    ``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups``) drop.
    ``FALLBACK``: no group is marked, so ``KVCacheCoordinator.__init__``
    conservatively flags every group (vllm/v1/core/kv_cache_coordinator.py).
    """

    NONE = "none"
    ANNOTATED = "annotated"
    FALLBACK = "fallback"


class MambaPrefill(StrEnum):
    """Where prefill steps end for a model with Mamba groups (a Mamba state
    exists only where a step ended).

    ``SCHEDULER`` (the default) is vLLM's own chunking,
    ``Scheduler._mamba_block_aligned_split`` in vllm/v1/core/sched/scheduler.py
    (called by the driver): the chunk budget ends long steps on the block grid
    and steps stop at the last cacheable block boundary, at the prompt's
    fine-grained checkpoint and at the shared-prefix junction. ``BLOCK`` is a
    block-carved prefill: a step ends at every Mamba block boundary and at the
    prompt end, with no other stop; it is how vLLM's own manager tests feed
    ``allocate_slots`` and how the upstream measurements of vLLM PR #57444
    were taken. ``CHECKPOINT`` is vLLM's own chunking for a Mamba layer that
    exports the prompt's checkpoint state from inside a step (one prefill
    checkpoint block at alignment 1, ``MambaSpec.num_prefill_checkpoint_blocks``,
    as vLLM 0.33.0's ``MambaMixer2.get_kv_cache_spec`` declares it,
    vllm/model_executor/layers/mamba/mamba_mixer2.py): the final step need
    not stop at the checkpoint (``Scheduler._mamba_block_aligned_split``'s
    internal checkpoint; ``MambaManager`` keeps it in a checkpoint block).
    """

    SCHEDULER = "scheduler"
    BLOCK = "block"
    CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: layers sharing a spec (vLLM ``KVCacheGroupSpec``).

    Attributes:
        kind: the attention type (:class:`GroupKind`).
        block_size_tokens: the group's block size, in tokens (for a Mamba
            group vLLM's ``mamba_block_size``: one state per block).
        sliding_window_tokens: the attention window in tokens (sliding-window
            and sliding-window MLA groups; an R-SWA group's ``rswa_window``,
            the decoded tokens it keeps; ``None`` otherwise).
        attention_chunk_size_tokens: the attention chunk in tokens (chunked
            local attention only, vLLM's ``attention_chunk_size``; ``None``
            otherwise). Written to JSON only when set.
        is_eagle_group: the group holds the drafter's own layers and takes the
            EAGLE block drop, as vLLM's planner sets
            ``KVCacheGroupSpec.is_eagle_group``. Written to JSON only when true.
        sink_len_tokens: the static sink's length in tokens (sink full
            attention only, vLLM's ``SinkFullAttentionSpec.sink_len``, a
            positive multiple of the block size; ``None`` otherwise). Written
            to JSON only when set.
        bounded_replay: DeepSeek-V4.1's SWA bounded replay (vLLM PR #56227,
            ``SlidingWindowMLASpec(bounded_replay=True)``; sliding-window MLA
            only): the group leaves prefix caching (``prefix_cacheable`` is
            false, so no lookup reads it) and after a hit ending at ``H``
            tokens the Scheduler recomputes the hit's last window
            ``[H - window, H)`` to rebuild it
            (``Scheduler._mark_prefix_replay``). Written to JSON only when
            true.
    """

    kind: GroupKind
    block_size_tokens: int
    sliding_window_tokens: int | None = None
    attention_chunk_size_tokens: int | None = None
    is_eagle_group: bool = False
    sink_len_tokens: int | None = None
    bounded_replay: bool = False

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the group takes part in prefix caching (vLLM
        ``KVCacheSpec.prefix_cacheable``): false for a circular buffer and
        for a bounded-replay sliding-window MLA group."""
        return self.kind.prefix_cacheable and not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        """The tokens a hit replays for this group, in tokens (vLLM
        ``KVCacheSpec.prefix_replay_tokens``): the window of a bounded-replay
        group, 0 otherwise."""
        return (self.sliding_window_tokens or 0) if self.bounded_replay else 0

    @property
    def num_sink_blocks(self) -> int:
        """The sink's blocks, in blocks (0 without a sink): the physical
        blocks ``1 .. num_sink_blocks`` hold it
        (vllm/model_executor/layers/attention/static_sink_attention.py)."""
        return (self.sink_len_tokens or 0) // self.block_size_tokens

    def validate(self, where: str) -> None:
        """The rules between the group's fields (its types and ranges are the
        JSON form's, :mod:`differential.scenario.json_form`).

        Raises:
            ScenarioError: naming ``where``: a window without a sliding-window
                kind (or none with one), a chunk without chunked local
                attention (or none with it), a sink length without sink full
                attention (or none, or one not a multiple of the block, with
                it), a Mamba or circular-buffer group marked as a draft group,
                bounded replay on a group that is not sliding-window MLA.
        """
        window = self.kind.windowed
        if window and self.sliding_window_tokens is None:
            raise ScenarioError(
                f"{where}.sliding_window_tokens", None, f"an integer >= 1 for a {self.kind} group"
            )
        if not window and self.sliding_window_tokens is not None:
            raise ScenarioError(
                f"{where}.sliding_window_tokens",
                self.sliding_window_tokens,
                f"null for a {self.kind.value} group",
            )
        chunked = self.kind is GroupKind.CHUNKED_LOCAL_ATTENTION
        if chunked and self.attention_chunk_size_tokens is None:
            raise ScenarioError(
                f"{where}.attention_chunk_size_tokens",
                None,
                f"an integer >= 1 for a {self.kind} group",
            )
        if not chunked and self.attention_chunk_size_tokens is not None:
            raise ScenarioError(
                f"{where}.attention_chunk_size_tokens",
                self.attention_chunk_size_tokens,
                f"null for a {self.kind.value} group",
            )
        self._validate_sink(where)
        if self.bounded_replay and self.kind is not GroupKind.SLIDING_WINDOW_MLA:
            # SlidingWindowMLASpec is the only spec with the field.
            raise ScenarioError(
                f"{where}.bounded_replay",
                True,
                f"false for a {self.kind.value} group (only sliding_window_mla groups replay)",
            )
        if self.is_eagle_group and not self.prefix_cacheable:
            # verify_and_split_kv_cache_groups skips a group that is not
            # prefix-cacheable before it reads the EAGLE mark.
            raise ScenarioError(
                f"{where}.is_eagle_group",
                True,
                f"false for a {self.kind.value} group (it takes no part in prefix caching, "
                "so it has no EAGLE block to drop)",
            )
        if self.is_eagle_group and self.kind is GroupKind.MAMBA:
            # HybridKVCacheCoordinator.find_longest_cache_hit: draft models
            # have no Mamba layers (the Mamba finder never drops).
            raise ScenarioError(
                f"{where}.is_eagle_group",
                True,
                "false for a mamba group (a drafter has no Mamba layers)",
            )

    def _validate_sink(self, where: str) -> None:
        """A sink length exactly for sink full attention, a positive multiple
        of the block (``SinkFullAttentionManager.__init__`` asserts
        ``sink_len % block_size == 0``)."""
        sink = self.kind is GroupKind.SINK_FULL_ATTENTION
        if not sink:
            if self.sink_len_tokens is not None:
                raise ScenarioError(
                    f"{where}.sink_len_tokens",
                    self.sink_len_tokens,
                    f"null for a {self.kind.value} group",
                )
            return
        if self.sink_len_tokens is None or self.sink_len_tokens % self.block_size_tokens:
            raise ScenarioError(
                f"{where}.sink_len_tokens",
                self.sink_len_tokens,
                f"a positive multiple of the block size ({self.block_size_tokens}) for a "
                f"{self.kind.value} group (SinkFullAttentionManager asserts it)",
            )

    @property
    def spec_key(self) -> tuple[object, ...]:
        """What makes two groups' vLLM specs equal (kind, block, window, chunk,
        sink, bounded replay).

        ``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups`` looks up
        groups of equal spec together and decides the EAGLE drop for all of
        them at once.
        """
        return (
            self.kind,
            self.block_size_tokens,
            self.sliding_window_tokens,
            self.attention_chunk_size_tokens,
            self.sink_len_tokens,
            self.bounded_replay,
        )
