"""The speculative-decoding drafter of a scenario.

Units: ``num_speculative_tokens`` is tokens drafted per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from differential.errors import ScenarioError

__all__ = ["DROPPING_DRAFTERS", "Drafter", "DrafterKind"]

# Drafters whose draft KV reads the next token(s): vLLM
# SpeculativeConfig.needs_eagle_block_drop (use_eagle and not DFlash/DSpark);
# Gemma-4 MTP counts as stock vLLM 0.33.0 drops for it.
DROPPING_DRAFTERS = frozenset({"eagle", "eagle3", "mtp", "multi_module_mtp", "gemma4_mtp"})


class DrafterKind(StrEnum):
    """Speculative-decoding drafter, as ``SpeculativeConfig.method`` plus model type.

    ``MULTI_MODULE_MTP`` is ``method="mtp"`` with one MTP module per speculative
    token (``num_nextn_predict_layers``); ``GEMMA4_MTP`` is ``method="mtp"``
    with a ``gemma4_mtp`` draft model (vLLM ``config/speculative.py``).
    """

    NONE = "none"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MTP = "mtp"
    MULTI_MODULE_MTP = "multi_module_mtp"
    GEMMA4_MTP = "gemma4_mtp"
    DFLASH = "dflash"
    DSPARK = "dspark"
    DRAFT_MODEL = "draft_model"
    NGRAM = "ngram"


@dataclass(frozen=True)
class Drafter:
    """The speculative-decoding drafter.

    Attributes:
        kind: which drafter (``DrafterKind.NONE`` for plain decoding).
        num_speculative_tokens: tokens drafted per step; 0 exactly when
            ``kind`` is ``none``.
    """

    kind: DrafterKind = DrafterKind.NONE
    num_speculative_tokens: int = 0

    def validate(self) -> None:
        """The rule between kind and token count (types and ranges are the JSON
        form's).

        Raises:
            ScenarioError: ``drafter.num_speculative_tokens`` not 0 without a
                drafter, under 1 with one, under 2 for multi-module MTP.
        """
        if self.kind is DrafterKind.NONE:
            if self.num_speculative_tokens != 0:
                raise ScenarioError(
                    "drafter.num_speculative_tokens",
                    self.num_speculative_tokens,
                    "0 when drafter.kind is 'none'",
                )
            return
        # vLLM SpeculativeConfig._verify_args: num_speculative_tokens > 0.
        if self.num_speculative_tokens < 1:
            raise ScenarioError(
                "drafter.num_speculative_tokens",
                self.num_speculative_tokens,
                f"an integer >= 1 when drafter.kind is {self.kind.value!r}",
            )
        if self.kind is DrafterKind.MULTI_MODULE_MTP and self.num_speculative_tokens < 2:
            raise ScenarioError(
                "drafter.num_speculative_tokens",
                self.num_speculative_tokens,
                "at least 2 for multi_module_mtp (one MTP module per token)",
            )
