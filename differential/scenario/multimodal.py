"""Multimodal inputs and cache salts: where each request's images lie, and
the content the oracle compares.

vLLM's block hash covers more than a block's token ids
(vllm/v1/core/kv_cache_utils.py ``generate_block_hash_extra_keys``): every
multimodal input whose placeholder tokens overlap the block adds its
identifier and its offset within the block (``_gen_mm_extra_hash_keys``),
and the request's ``cache_salt`` is added to the first block's. Since each
hash chains to its parent's (``hash_block_tokens``), two prompts share a
block exactly when every position up to its end (and its lookahead tokens)
holds the same *content*: the same token id, and, where an image lies, the
same image at the same offset in it, under the same salt.

So kvfuzz gives every position a content id (:class:`ContentCoder`): the
token id outside images, a code for (identifier, offset in the image) inside
one, both moved into a range of their own per salt. Two requests share a
prefix of content exactly when vLLM's hashes agree on it, and the oracle's
shared-prefix computations (``differential/oracle/prefix.py``) run on
content ids instead of token ids; without images and salts the content ids
are the token ids.

Units: offsets and lengths are tokens. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from differential.scenario.workload import RequestSpec

__all__ = [
    "MM_PLACEHOLDER_TOKEN_ID",
    "ContentCoder",
    "PlacedInput",
    "placed_inputs",
    "split_input",
]

#: The token id of every image placeholder token: one fixed id, as a
#: multimodal model's processor expands an image into runs of its image
#: token (between kvfuzz's prefix ids, at most 50000, and the requests' own
#: ids, from 1000000 on, so it collides with neither).
MM_PLACEHOLDER_TOKEN_ID: Final = 999_999


@dataclass(frozen=True)
class PlacedInput:
    """An image as it lies in a request's prompt: vLLM's
    ``PlaceholderRange(offset, length)`` with the image's identifier.

    Attributes:
        offset_tokens: position of its first placeholder token in the prompt, in tokens.
        length_tokens: its placeholder tokens, in tokens.
        identifier: the image's identity (``MultiModalFeatureSpec.identifier``).
    """

    offset_tokens: int
    length_tokens: int
    identifier: str

    @property
    def end_tokens(self) -> int:
        """The position just past its last placeholder token, in tokens."""
        return self.offset_tokens + self.length_tokens


def _own_inputs(request: RequestSpec) -> list[PlacedInput]:
    base = request.divergence_tokens
    return [
        PlacedInput(base + m.suffix_offset_tokens, m.length_tokens, m.identifier)
        for m in request.mm_inputs
    ]


def split_input(inputs: Sequence[PlacedInput], position: int) -> PlacedInput | None:
    """The input of ``inputs`` that ``position`` (tokens) cuts in two, i.e.
    that starts before it and ends after it, or ``None``."""
    return next((p for p in inputs if p.offset_tokens < position < p.end_tokens), None)


def placed_inputs(requests: Sequence[RequestSpec]) -> tuple[tuple[PlacedInput, ...], ...]:
    """Per request, every image in its prompt, sorted by offset: the
    source's images in the copied tokens (``[0, D)``, and the rejoined
    ``[D + suffix, D + suffix + rejoin)``), and its own
    (``RequestSpec.mm_inputs``, moved to prompt positions). A source's image
    that a copy boundary cuts is not a copy of it (the scenario's rules
    refuse such a boundary, :func:`differential.scenario.rules.check_mm_inputs`).
    The shared prefix holds no image.
    """
    out: list[tuple[PlacedInput, ...]] = []
    for request in requests:
        source = () if request.shares_with is None else out[request.shares_with]
        divergence = request.divergence_tokens
        copied = [p for p in source if p.end_tokens <= divergence]
        rejoined: list[PlacedInput] = []
        if request.rejoin_tokens:
            start = divergence + request.suffix_tokens
            end = start + request.rejoin_tokens
            rejoined = [p for p in source if start <= p.offset_tokens and p.end_tokens <= end]
        out.append(tuple(copied + _own_inputs(request) + rejoined))
    return tuple(out)


@dataclass(frozen=True)
class ContentCoder:
    """Content ids for one scenario's positions (see the module docstring).

    A token id ``t`` of a request with salt rank ``s`` (0: no salt) is
    ``t + s * salt_stride``; the ``k``-th placeholder token of an image of
    identifier rank ``i`` is ``token_span + i * image_stride + k + s *
    salt_stride``. Every token id is below ``token_span``, every image below
    ``image_stride`` tokens, and ``salt_stride`` is above every unsalted
    content id, so the map is one-to-one.

    Attributes:
        token_span: one more than the largest token id the scenario uses.
        image_stride: one more than its longest image, in tokens.
        identifier_ranks: identifier -> its rank in sorted order.
        salt_stride: the distance between two salts' ranges of content ids.
        salt_ranks: per request, its salt's rank in sorted order plus 1 (0: no salt).
    """

    token_span: int
    image_stride: int
    identifier_ranks: Mapping[str, int]
    salt_stride: int
    salt_ranks: tuple[int, ...]

    @classmethod
    def build(
        cls,
        requests: Sequence[RequestSpec],
        inputs: Sequence[Sequence[PlacedInput]],
        largest_token_id: int,
    ) -> ContentCoder:
        """The coder for requests with these placed inputs whose prompts and
        sampled tokens use token ids up to ``largest_token_id``."""
        identifiers = sorted({p.identifier for placed in inputs for p in placed})
        longest = max((p.length_tokens for placed in inputs for p in placed), default=0)
        salts = sorted({r.cache_salt for r in requests if r.cache_salt is not None})
        salt_rank = {salt: k + 1 for k, salt in enumerate(salts)}
        token_span = largest_token_id + 1
        image_stride = longest + 1
        return cls(
            token_span=token_span,
            image_stride=image_stride,
            identifier_ranks={ident: k for k, ident in enumerate(identifiers)},
            salt_stride=token_span + len(identifiers) * image_stride,
            salt_ranks=tuple(
                0 if r.cache_salt is None else salt_rank[r.cache_salt] for r in requests
            ),
        )

    def tokens(self, request: int, tokens: Sequence[int]) -> tuple[int, ...]:
        """Content ids of ``tokens`` outside any image, for request ``request``."""
        shift = self.salt_ranks[request] * self.salt_stride
        return tuple(tokens) if not shift else tuple(t + shift for t in tokens)

    def prompt(
        self, request: int, tokens: Sequence[int], inputs: Sequence[PlacedInput]
    ) -> tuple[int, ...]:
        """Content ids of request ``request``'s prompt ``tokens`` with its
        placed ``inputs``."""
        shift = self.salt_ranks[request] * self.salt_stride
        content = [t + shift for t in tokens]
        for placed in inputs:
            base = (
                self.token_span
                + self.identifier_ranks[placed.identifier] * self.image_stride
                + shift
            )
            content[placed.offset_tokens : placed.end_tokens] = range(
                base, base + placed.length_tokens
            )
        return tuple(content)
