"""The explain picture's SVG (no vLLM): nothing cut at the right edge, and an
over-hit row that says how much may be reused."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET

from differential.exports.explain import VariantRow, explanation, render_svg
from differential.oracle import SiblingReference
from tests.factories import triton

# The narrowest common monospace fonts are 0.6 em wide per character.
_MIN_CHAR_EM = 0.6


def test_svg_is_as_wide_as_its_texts_and_names_the_over_hit_ceiling() -> None:
    scenario = dataclasses.replace(triton(), name="a-scenario-with-a-long-descriptive-name-" * 2)
    reference = SiblingReference(
        index=1,
        divergence_tokens=16384,
        dense_tokens=16352,
        expected_tokens=16352,
        writer=0,
        checkpoints=(8192, 16352),
    )
    maps = ("1" * 511, "1" * 1022)
    rows = [
        VariantRow("unfixed", 16352, maps, ("over-hit",), reusable_tokens=16320),
        VariantRow("fixed", 16352, maps, ()),
    ]
    svg = ET.fromstring(render_svg(explanation(scenario, 1, reference, rows)))
    width = float(svg.attrib["width"])
    texts = [e for e in svg.iter() if e.tag.endswith("text")]
    for element in texts:
        size = float(element.attrib.get("font-size", svg.attrib["font-size"]))
        end = float(element.attrib["x"]) + len(element.text or "") * size * _MIN_CHAR_EM
        assert end <= width, (element.text, end, width)
    words = [e.text for e in texts]
    # The hit equals the expected checkpoint: the row says why it is an
    # over-hit, and the ceiling is drawn beside "expected 16352".
    assert "hit 16352: over-hit (at most 16320 reusable)" in words
    assert "hit 16352: ok" in words
    assert "expected 16352" in words and "reusable 16320 (over-hit above)" in words
