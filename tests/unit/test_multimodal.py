"""Multimodal inputs and cache salts in scenarios, on hand-worked cases (no vLLM).

Geometry for the oracle cases: one full-attention group of block 16. The
writer is a 16-token system prefix, 8 tokens of text, a 40-token image
``cat`` at ``[24, 64)`` and a 36-token question (100 tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from differential.errors import ScenarioError
from differential.findings import FindingKind
from differential.observation import (
    BlockRecord,
    ManagerSettings,
    RequestObservation,
    RunObservation,
)
from differential.oracle import dense_hit, divergence_points, drafter_model, judge_run
from differential.oracle.blocks import TokenView, ViolationKind, request_violations
from differential.oracle.prefix import shared_prefixes
from differential.scenario import (
    MM_PLACEHOLDER_TOKEN_ID,
    Drafter,
    DrafterKind,
    GroupKind,
    KVCacheGroup,
    MultiModalInput,
    PlacedInput,
    RequestSpec,
    Scenario,
    Workload,
)

FULL16 = (KVCacheGroup(GroupKind.FULL_ATTENTION, 16),)
CAT = MultiModalInput(8, 40, "cat")
WRITER = RequestSpec(16, 84, name="writer", mm_inputs=(CAT,))


def scenario(*requests: RequestSpec) -> Scenario:
    return Scenario(kv_cache_groups=FULL16, shared_prefix_tokens=16, requests=(WRITER, *requests))


# Request 1 resends the writer with the same image and asks on (D = 100);
# request 2 swaps the image for "dog", every token id the writer's; request 3
# copies the writer up to the image, then the same image at the same place
# and its own question.
SIBLINGS = scenario(
    RequestSpec(100, 16, shares_with=0),
    RequestSpec(
        24, 40, shares_with=0, rejoin_tokens=36, mm_inputs=(MultiModalInput(0, 40, "dog"),)
    ),
    RequestSpec(24, 52, shares_with=0, mm_inputs=(MultiModalInput(0, 40, "cat"),)),
)


def test_images_are_placed_where_the_copies_put_them() -> None:
    cat = PlacedInput(24, 40, "cat")
    assert SIBLINGS.mm_placements == (
        (cat,),
        (cat,),  # copied with the writer's tokens
        (PlacedInput(24, 40, "dog"),),  # own; the writer's cat is not in the copy
        (cat,),  # own, equal to the writer's
    )
    assert cat.end_tokens == 64


def test_image_tokens_are_placeholders() -> None:
    writer, resend, swap, same = SIBLINGS.prompts
    assert writer[24:64] == (MM_PLACEHOLDER_TOKEN_ID,) * 40
    assert writer[23] == 1_000_007 and writer[64] == 1_000_048  # own text around it
    # The swap has every token id of the writer: only the image differs.
    assert swap == writer
    assert resend[:100] == writer
    assert same[:64] == writer[:64] and same[64] == 4_000_040


def test_shared_prefixes_compare_content() -> None:
    # Request 1 shares all 100 tokens; the swap only the 24 before its image,
    # though its tokens are the writer's; the same image at the same place
    # shares through it (64), with the swap too up to 24.
    assert shared_prefixes(SIBLINGS) == [[], [100], [24, 24], [64, 64, 24]]
    assert divergence_points(SIBLINGS) == (0, 100, 24, 64)
    assert SIBLINGS.contents[2][:24] == SIBLINGS.contents[0][:24]
    assert SIBLINGS.contents[2][24] != SIBLINGS.contents[0][24]


def test_without_images_or_salts_contents_are_the_prompts() -> None:
    plain = Scenario(
        kv_cache_groups=FULL16, shared_prefix_tokens=16, requests=(RequestSpec(16, 8),)
    )
    assert plain.contents is plain.prompts
    assert plain.sampled_contents(0) == plain.sampled_tokens(0)


def test_cache_salts_isolate_tenants() -> None:
    # Tenant a writes; tenant b resends the same prompt (nothing shared);
    # tenant a resends it (all 100 shared); an unsalted resend shares nothing.
    salted = Scenario(
        kv_cache_groups=FULL16,
        shared_prefix_tokens=16,
        requests=(
            dataclasses.replace(WRITER, cache_salt="a"),
            RequestSpec(100, 4, shares_with=0, cache_salt="b"),
            RequestSpec(100, 4, shares_with=0, cache_salt="a"),
            RequestSpec(100, 4, shares_with=0),
        ),
    )
    assert salted.prompts[1][:100] == salted.prompts[0]
    assert shared_prefixes(salted) == [[], [0], [100, 0], [0, 0, 0]]
    # A sampled token is salted too (a copied answer shares only under the same salt).
    assert salted.sampled_contents(0) != salted.sampled_tokens(0)
    assert salted.sampled_contents(3) == salted.sampled_tokens(3)


def test_dense_reference_of_a_swapped_image() -> None:
    # The swap shares 24 tokens: one block (16); the same image at the same
    # place shares 64: four blocks.
    model = drafter_model(SIBLINGS)
    assert dense_hit(SIBLINGS, model, 2, 0, 24) == 16
    assert dense_hit(SIBLINGS, model, 3, 0, 64) == 64


def _question_after_image(drafter: Drafter) -> Scenario:
    # Image "chart" at [16, 49) then a question; the sibling keeps the image
    # and asks another question: the content parts at 49, one token past the
    # block boundary 48.
    return Scenario(
        kv_cache_groups=FULL16,
        shared_prefix_tokens=16,
        drafter=drafter,
        requests=(
            RequestSpec(16, 53, mm_inputs=(MultiModalInput(0, 33, "chart"),)),
            RequestSpec(49, 20, shares_with=0),
        ),
    )


@pytest.mark.parametrize(
    ("drafter", "lookahead", "owed"),
    [
        # EAGLE reads the next token: block [32, 48) hashes token 48 (the
        # image's last) too, equal: owed 48.
        (Drafter(DrafterKind.EAGLE, 1), 1, 48),
        # Two MTP modules read two tokens: block [32, 48) hashes 48 and 49,
        # and 49 differs: owed 32 (49 - 2 = 47, down to the block).
        (Drafter(DrafterKind.MULTI_MODULE_MTP, 2), 2, 32),
    ],
)
def test_lookahead_tokens_past_an_image(drafter: Drafter, lookahead: int, owed: int) -> None:
    s = _question_after_image(drafter)
    model = drafter_model(s)
    assert model.hash_lookahead_tokens == lookahead
    assert divergence_points(s) == (0, 49)
    refs, findings = judge_run(s, _run([0, owed]))
    assert [r.dense_tokens for r in refs] == [0, owed]
    assert findings == ()
    if lookahead == 2:
        # Reusing block [32, 48), whose next-but-one token differs, is an over-hit.
        _, findings = judge_run(s, _run([0, 48]))
        assert [(f.kind, f.request, f.expected_tokens) for f in findings] == [
            (FindingKind.OVER_HIT, 1, 32)
        ]


def _run(hits: list[int], blocks: tuple[Any, ...] = ()) -> RunObservation:
    return RunObservation(
        variant="v",
        vllm_version="test",
        settings=ManagerSettings(False, 0, 0, 0, 16),
        requests=tuple(
            RequestObservation(
                i,
                0,
                h,
                0,
                (h,),
                (0,),
                lookup_blocks=blocks[i] if blocks else (),
            )
            for i, h in enumerate(hits)
        ),
        blocks_recorded=bool(blocks),
    )


def test_a_swapped_image_reusing_the_writers_blocks_is_an_over_hit_and_wrong_kv() -> None:
    # Only the writer and the swap: the swap may reuse block 0 (16 tokens).
    s = Scenario(
        kv_cache_groups=FULL16,
        shared_prefix_tokens=16,
        requests=(WRITER, SIBLINGS.requests[2]),
    )
    assert judge_run(s, _run([0, 16]))[1] == ()
    # A cache that hashed token ids alone would hand it 96 tokens.
    blocks = ((), (tuple(BlockRecord(10 + k, 0, 0, k, 16) for k in range(6)),))
    _, findings = judge_run(s, _run([0, 96], blocks))
    assert sorted((f.kind.value, f.request) for f in findings) == [
        ("over-hit", 1),
        ("wrong-kv", 1),
    ]
    view = TokenView(s)
    violations = request_violations(s, _run([0, 96], blocks).requests[1], view)
    # Blocks 1.. hold the cat image's tokens (block 1 from position 24 on).
    assert [(v.kind, v.block_index) for v in violations] == [
        (ViolationKind.FOREIGN, k) for k in range(1, 6)
    ]


@pytest.mark.parametrize(
    ("requests", "field", "allowed"),
    [
        (
            (RequestSpec(16, 20, mm_inputs=(MultiModalInput(8, 20, "cat"),)),),
            "requests[0].mm_inputs[0].length_tokens",
            "at most 12 (an image lies among the request's 20 own tokens)",
        ),
        (
            (
                RequestSpec(
                    16, 40, mm_inputs=(MultiModalInput(8, 10, "a"), MultiModalInput(12, 10, "b"))
                ),
            ),
            "requests[0].mm_inputs[1].suffix_offset_tokens",
            "at least 18 (a request's images are in order and do not overlap)",
        ),
        (
            (WRITER, RequestSpec(16, 30, mm_inputs=(MultiModalInput(0, 30, "cat"),))),
            "requests[1].mm_inputs[0].length_tokens",
            "40, the length of image 'cat' in requests[0] (an identifier is one image)",
        ),
        (
            (WRITER, RequestSpec(40, 4, shares_with=0)),
            "requests[1].divergence_tokens",
            "a value that puts no copy boundary inside requests[0]'s image 'cat' at "
            "[24, 64): this one puts it at 40 (a copy of an image is whole: boundaries at 24 "
            "or 64)",
        ),
        (
            (WRITER, RequestSpec(20, 20, shares_with=0, rejoin_tokens=4)),
            "requests[1].suffix_tokens",
            "a value that puts no copy boundary inside requests[0]'s image 'cat' at "
            "[24, 64): this one puts it at 40 (a copy of an image is whole: boundaries at 24 "
            "or 64)",
        ),
        (
            (WRITER, RequestSpec(20, 2, shares_with=0, rejoin_tokens=8)),
            "requests[1].rejoin_tokens",
            "a value that puts no copy boundary inside requests[0]'s image 'cat' at "
            "[24, 64): this one puts it at 30 (a copy of an image is whole: boundaries at 24 "
            "or 64)",
        ),
    ],
)
def test_image_rules_name_the_field(
    requests: tuple[RequestSpec, ...], field: str, allowed: str
) -> None:
    with pytest.raises(ScenarioError) as info:
        Scenario(kv_cache_groups=FULL16, shared_prefix_tokens=16, requests=requests)
    assert (info.value.field, info.value.allowed) == (field, allowed)


def test_json_form_writes_images_and_salts_only_when_set() -> None:
    s = dataclasses.replace(
        SIBLINGS,
        requests=(*SIBLINGS.requests, RequestSpec(16, 4, cache_salt="tenant-a")),
        workload=Workload(),
    )
    data = s.to_dict()
    assert data["requests"][0]["mm_inputs"] == [
        {"suffix_offset_tokens": 8, "length_tokens": 40, "identifier": "cat"}
    ]
    assert "mm_inputs" not in data["requests"][1] and "cache_salt" not in data["requests"][1]
    assert data["requests"][4]["cache_salt"] == "tenant-a"
    assert Scenario.from_dict(data) == s
    assert Scenario.from_json(s.to_json()).to_json() == s.to_json()


@pytest.mark.parametrize(
    ("request_json", "field", "allowed"),
    [
        ({"cache_salt": ""}, "requests[0].cache_salt", "null or a non-empty string"),
        (
            {"mm_inputs": [{"suffix_offset_tokens": 0, "length_tokens": 0, "identifier": "a"}]},
            "requests[0].mm_inputs[0].length_tokens",
            "an integer >= 1",
        ),
        (
            {"mm_inputs": [{"suffix_offset_tokens": 0, "length_tokens": 1, "identifier": ""}]},
            "requests[0].mm_inputs[0].identifier",
            "a non-empty string",
        ),
    ],
)
def test_json_form_names_bad_image_fields(
    request_json: dict[str, object], field: str, allowed: str
) -> None:
    data = SIBLINGS.to_dict()
    data["requests"] = [{"divergence_tokens": 16, "suffix_tokens": 4, **request_json}]
    with pytest.raises(ScenarioError) as info:
        Scenario.from_dict(data)
    assert (info.value.field, info.value.allowed) == (field, allowed)


def test_shrink_steps_drop_and_scale_images() -> None:
    from fuzz.minimize import _multimodal, _numbers, _scaled

    salted = dataclasses.replace(
        SIBLINGS,
        requests=(
            dataclasses.replace(
                WRITER, mm_inputs=(MultiModalInput(0, 4, "icon"), CAT), cache_salt="a"
            ),
            *SIBLINGS.requests[1:],
        ),
    )
    steps = dict(_multimodal(salted))
    assert list(steps) == [
        "no images",
        "request 0 without images",
        "request 0 without a cache salt",
        "request 2 without images",
        "request 3 without images",
        "request 0 without image 0",
        "request 0 without image 1",
    ]
    bare = steps["request 0 without images"]
    assert bare is not None and bare.mm_placements[0] == ()
    assert bare.mm_placements[2] == (PlacedInput(24, 40, "dog"),)
    half = _scaled(SIBLINGS, 1, 2)
    assert half is not None
    assert half.mm_placements[0] == (PlacedInput(12, 20, "cat"),)
    # A shorter suffix keeps the images that still fit: request 3's 52 own
    # tokens halved to 26 drop its 40-token image.
    shorter = dict(_numbers(SIBLINGS))["request 3 suffix 26"]
    assert shorter is not None and shorter.requests[3].mm_inputs == ()


def test_generator_reaches_a_swapped_image() -> None:
    from tests.factories import reach

    def swapped(s: Scenario) -> bool:
        return any(
            r.name == "image swapped"
            and r.shares_with is not None
            and s.prompts[i] == s.prompts[r.shares_with][: len(s.prompts[i])]
            and divergence_points(s)[i] <= r.divergence_tokens
            for i, r in enumerate(s.requests)
        )

    found = reach(swapped)
    assert found.has_mm_inputs


def test_the_picture_marks_the_requests_images() -> None:
    import xml.etree.ElementTree as ET

    from differential.exports.explain import VariantRow, explanation, render_svg, render_text
    from differential.oracle import SiblingReference

    reference = SiblingReference(2, 24, 16, 16, 0, (0, 16))
    rows = [VariantRow("unfixed", 16, ("100000",), ())]
    exp = explanation(SIBLINGS, 2, reference, rows)
    text = render_text(exp)
    # Columns of 16 tokens from 0: the dog image [24, 64) covers columns 1..3.
    assert "images              ▒▒▒   image 'dog' [24, 64)\n" in text
    assert "▒ image placeholder tokens" in text
    svg = ET.fromstring(render_svg(exp))
    titles = [e.text for e in svg.iter() if e.tag.endswith("title")]
    assert "image dog [24, 64)" in titles
