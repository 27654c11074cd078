"""``kvfuzz explain``: the blocks each variant kept around one sibling's divergence.

For one sibling, renders which prompt blocks of each KV cache group were in
the prefix cache when it looked up, per variant, over the stretch of tokens
that decides its hit (from below the tail of the expected checkpoint to a few
blocks past the divergence point), with the divergence point, the expected
checkpoint, each variant's hit and the periodic checkpoints marked. Text for
the terminal, SVG for a picture. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING

from differential.findings import Finding, FindingKind
from differential.oracle import SiblingReference
from differential.oracle.blocks import render_blocks
from differential.scenario import GroupKind, KVCacheGroup, Scenario

if TYPE_CHECKING:
    from differential.compare import ScenarioResult

__all__ = [
    "Explanation",
    "VariantRow",
    "explain_request",
    "explanation",
    "render_svg",
    "render_text",
]


@dataclass(frozen=True)
class VariantRow:
    """One variant's view of the sibling.

    Attributes:
        variant: the variant's name.
        hit_tokens: its hit, in tokens.
        cache_maps: per group, ``"1"``/``"0"`` per prompt block: cached at lookup.
        verdicts: finding kinds reported for the sibling on this variant.
        lookup_blocks: per group, the block ids its lookup handed out
            (``None``: the null block); shown for ``wrong-kv``.
        crash: vLLM's error when the variant crashed on this request (its
            cache maps are then those taken at the request's lookup, before
            the crash, and ``hit_tokens`` is 0); ``None`` otherwise.
        reusable_tokens: for an ``over-hit``, the most tokens the request
            may reuse (the over-hit finding's ceiling), in tokens; ``None``
            otherwise.
    """

    variant: str
    hit_tokens: int
    cache_maps: tuple[str, ...]
    verdicts: tuple[str, ...]
    lookup_blocks: tuple[tuple[int | None, ...], ...] = ()
    crash: str | None = None
    reusable_tokens: int | None = None

    @property
    def outcome(self) -> str:
        """``hit N`` or ``crashed``, for the picture's right-hand column."""
        return "crashed" if self.crash is not None else f"hit {self.hit_tokens}"

    @property
    def verdict(self) -> str:
        """The verdicts in words: ``ok``, ``fallback``; an over-hit says how
        much may be reused (``over-hit (at most 304 reusable)``), since the
        hit may equal the expected checkpoint."""
        words = [
            f"{v} (at most {self.reusable_tokens} reusable)"
            if v == "over-hit" and self.reusable_tokens is not None
            else v
            for v in self.verdicts
        ]
        return ", ".join(words) or "ok"


@dataclass(frozen=True)
class Explanation:
    """Everything the renderers need.

    Attributes:
        scenario: the scenario.
        request: the sibling's index.
        reference: what the oracle says it is owed.
        rows: one per variant.
        start_tokens, end_tokens: the token range shown.
    """

    scenario: Scenario
    request: int
    reference: SiblingReference
    rows: tuple[VariantRow, ...]
    start_tokens: int
    end_tokens: int

    @property
    def checkpoints(self) -> tuple[int, ...]:
        """Periodic checkpoints ``k*R`` inside the shown range, in tokens."""
        retention = self.scenario.retention_interval_tokens
        if not retention:
            return ()
        first = -(-self.start_tokens // retention) * retention
        return tuple(range(max(first, retention), self.end_tokens + 1, retention))


def render_timeline(result: ScenarioResult, request: int) -> str:
    """A scheduler-mode scenario as a timeline of scheduler steps, per variant.

    Reruns each variant recording its timeline
    (``RunObservation.timeline``: arrivals, admissions with their hits,
    tokens scheduled per request, drafts accepted, preemptions, finished
    requests, evictions), then lists each request's admitting lookup:
    scheduler step, hit in tokens and, per KV cache group, which of its
    prompt blocks were cached then (``1``), with the findings on it.
    ``request`` is marked.
    """
    from differential.compare import run_any
    from differential.reports.table import connector_summary, engine_summary

    lines: list[str] = []
    for vr in result.results:
        run = run_any(result.scenario, vr.variant, record_cache_map=True)
        lines.append(f"{vr.variant.name}: {engine_summary(run)}")
        lines += [f"  {line}" for line in run.timeline]
        lines += [f"  {connector_summary(obs)}" for obs in run.requests if obs.connector]
        lines.append(f"  {'req':>4} {'step':>5} {'hit':>6}  cached prompt blocks per group")
        for obs in run.requests:
            kinds = sorted(
                {
                    f.kind.value
                    for f in result.findings
                    if f.request == obs.index and f.owner == vr.variant.name
                }
            )
            mark = ">" if obs.index == request else " "
            lines.append(
                f" {mark}{obs.index:>4} {obs.scheduled_step!s:>5} {obs.hit_tokens:>6}  "
                f"{' | '.join(obs.cache_map)}" + (f"  [{', '.join(kinds)}]" if kinds else "")
            )
        whole = [f.summary() for f in vr.findings if f.request is None]
        lines += [f"  ! {text}" for text in whole]
    return "\n".join(lines) + "\n"


def explanation(
    scenario: Scenario,
    request: int,
    reference: SiblingReference,
    rows: Sequence[VariantRow],
) -> Explanation:
    """Choose the token range to show for ``request`` and bundle the rows.

    The range starts one widened SWA tail (window plus peek plus one alignment
    unit, plus two blocks of margin) below the expected checkpoint and ends
    four SWA blocks past the divergence point.
    """
    alignment = scenario.effective_hit_alignment_tokens
    spans = [
        (g.sliding_window_tokens or 0) + 3 * g.block_size_tokens + alignment
        for g in scenario.sliding_window_groups
    ] or [4 * alignment]
    smallest = min(g.block_size_tokens for g in scenario.kv_cache_groups)
    start = max(0, reference.expected_tokens - max(spans))
    start -= start % alignment
    length = scenario.requests[request].prompt_tokens
    end = min(length, reference.divergence_tokens + 4 * smallest)
    end = max(end, start + smallest)
    return Explanation(scenario, request, reference, tuple(rows), start, end)


def explain_request(
    result: ScenarioResult,
    request: int,
    findings: Sequence[Finding] | None = None,
) -> Explanation | None:
    """Explain ``request`` of a judged scenario.

    Reruns each variant of ``result`` recording which blocks were cached at
    every lookup (this imports the driver, and so vLLM, on use); each row's
    verdicts are the kinds of ``findings`` (default: all of ``result``'s) on
    that request and variant.

    A variant that crashed on ``request`` (vLLM raised in its lookup or a
    later step) is drawn with the blocks cached when that lookup started
    (:attr:`~differential.observation.RunObservation.crash_cache_map`) and
    its error; the request's reference then comes from the oracle, from the
    hits of the requests before it.

    Returns:
        ``None`` when no variant completed the request or crashed on it.
    """
    from differential.compare import run_any
    from differential.oracle import drafter_model, references

    findings = result.findings if findings is None else findings
    rows = []
    before: tuple[int, ...] | None = None  # hits before a crashing request
    for vr in result.results:
        run = run_any(result.scenario, vr.variant, record_cache_map=True)
        verdicts = tuple(
            dict.fromkeys(
                f.kind.value
                for f in findings
                if f.request == request and f.owner == vr.variant.name
            )
        )
        reusable = next(
            (
                f.expected_tokens
                for f in findings
                if f.request == request
                and f.owner == vr.variant.name
                and f.kind is FindingKind.OVER_HIT
            ),
            None,
        )
        if request < len(run.requests):
            obs = run.requests[request]
            rows.append(
                VariantRow(
                    vr.variant.name,
                    obs.hit_tokens,
                    obs.cache_map,
                    verdicts,
                    obs.lookup_block_ids,
                    reusable_tokens=reusable,
                )
            )
        elif run.error is not None and run.crash_cache_map and len(run.requests) == request:
            rows.append(
                VariantRow(
                    vr.variant.name,
                    0,
                    run.crash_cache_map,
                    verdicts or ("crash",),
                    crash=run.error,
                )
            )
            before = run.hits if before is None else before
    if not rows:
        return None
    owed = next((vr.references for vr in result.results if request < len(vr.references)), None)
    if owed is not None:
        reference = owed[request]
    elif before is not None:
        scenario = result.scenario
        model = drafter_model(scenario)
        reference = references(scenario, model, (*before, 0), result.policy)[request]
    else:
        return None
    return explanation(result.scenario, request, reference, rows)


def _mark_line(exp: Explanation, column_tokens: int, width: int) -> str:
    marks = [" "] * width

    def put(tokens: int, char: str) -> None:
        col = (tokens - exp.start_tokens) // column_tokens
        if 0 <= col < width:
            marks[col] = char

    for c in exp.checkpoints:
        put(c, "|")
    put(exp.reference.expected_tokens, "e")
    put(exp.reference.divergence_tokens, "D")
    return "".join(marks)


def _image_line(exp: Explanation, column_tokens: int, width: int) -> str | None:
    """``▒`` in every column holding an image's placeholder tokens of the
    request (``Scenario.mm_placements``), ``None`` when it has no image."""
    placed = exp.scenario.mm_placements[exp.request]
    if not placed:
        return None
    cells = [" "] * width
    for col in range(width):
        lo = exp.start_tokens + col * column_tokens
        if any(p.offset_tokens < lo + column_tokens and lo < p.end_tokens for p in placed):
            cells[col] = "▒"
    return "".join(cells)


def _images_text(exp: Explanation) -> str:
    """The request's images in words: ``image 'cat' [24, 64)``."""
    return ", ".join(
        f"image {p.identifier!r} [{p.offset_tokens}, {p.end_tokens})"
        for p in exp.scenario.mm_placements[exp.request]
    )


def _column_tokens(scenario: Scenario) -> int:
    """Tokens per picture column: the smallest block, or the hash block when
    Mamba states sit at hash-block positions (fine-grained hits)."""
    column = min(g.block_size_tokens for g in scenario.kv_cache_groups)
    if scenario.mamba_groups:
        column = min(column, scenario.effective_hash_block_size_tokens)
    return column


def _group_kind_label(group: KVCacheGroup) -> str:
    """A group's row label: its kind, ``+r`` for bounded replay, ``*`` for a
    draft group."""
    if group.bounded_replay:
        return "swmla+r"
    return {
        GroupKind.FULL_ATTENTION: "full",
        GroupKind.MAMBA: "mamba",
        GroupKind.MLA: "mla",
        GroupKind.SLIDING_WINDOW_MLA: "swmla",
        GroupKind.CHUNKED_LOCAL_ATTENTION: "chunk",
        GroupKind.CIRCULAR_BUFFER: "ring",
        GroupKind.SINK_FULL_ATTENTION: "sink",
        GroupKind.RSWA: "rswa",
    }.get(group.kind, "swa") + ("*" if group.is_eagle_group else "")


def _state_cells(exp: Explanation, state_map: str, column: int, width: int) -> str:
    """A Mamba group's row: ``◆`` in the column ending at each cached state's
    position (the map has one character per hash block), ``·`` elsewhere."""
    hash_block = exp.scenario.effective_hash_block_size_tokens
    cells = ["·"] * width
    for index, mark in enumerate(state_map):
        position = (index + 1) * hash_block
        col = (position - 1 - exp.start_tokens) // column
        if mark == "1" and 0 <= col < width:
            cells[col] = "◆"
    return "".join(cells)


def render_text(exp: Explanation) -> str:
    """A compact block diagram, one line per variant and group; a Mamba
    group's row marks each cached state (one block at one position)."""
    scenario = exp.scenario
    ref = exp.reference
    column = _column_tokens(scenario)
    width = max(1, (exp.end_tokens - exp.start_tokens) // column)
    label_width = max(
        max(len(r.variant) for r in exp.rows) + 12,
        *(
            len(f"{r.variant} g{gid} {_group_kind_label(g)}{g.block_size_tokens}") + 1
            for r in exp.rows
            for gid, g in enumerate(scenario.kv_cache_groups)
        ),
    )
    lines = [
        f"request {exp.request}: divergence point {ref.divergence_tokens}, expected checkpoint "
        f"{ref.expected_tokens}, dense reference {ref.dense_tokens} "
        f"(A = {scenario.effective_hit_alignment_tokens}, "
        f"R = {scenario.retention_interval_tokens})",
        f"tokens {exp.start_tokens}..{exp.end_tokens}, one column per {column} tokens",
        " " * label_width + _mark_line(exp, column, width),
    ]
    images = _image_line(exp, column, width)
    if images is not None:
        lines.append(f"{'images':<{label_width}}{images}  {_images_text(exp)}")
    for row in exp.rows:
        for gid, group in enumerate(scenario.kv_cache_groups):
            kind = _group_kind_label(group)
            label = f"{row.variant} g{gid} {kind}{group.block_size_tokens}"
            cells = []
            cache_map = row.cache_maps[gid] if gid < len(row.cache_maps) else ""
            if group.kind is GroupKind.MAMBA:
                cells = [_state_cells(exp, cache_map, column, width)]
            for col in range(width if group.kind is not GroupKind.MAMBA else 0):
                block = (exp.start_tokens + col * column) // group.block_size_tokens
                cells.append("█" if block < len(cache_map) and cache_map[block] == "1" else "·")
            hit_col = (row.hit_tokens - exp.start_tokens) // column
            where = (
                row.outcome
                if 0 <= hit_col <= width or row.crash is not None
                else f"hit {row.hit_tokens} (left of the view)"
            )
            suffix = f"  {where}; {row.verdict}" if gid == len(scenario.kv_cache_groups) - 1 else ""
            lines.append(f"{label:<{label_width}}{''.join(cells)}{suffix}")
    lines.append(
        "█ cached at lookup  · not cached  | periodic checkpoint  e expected checkpoint  "
        "D divergence point"
        + ("  ◆ Mamba state cached (ends in that column)" if scenario.mamba_groups else "")
        + (
            "  ring: a circular buffer, never cached (one block per request)"
            if any(g.kind is GroupKind.CIRCULAR_BUFFER for g in scenario.kv_cache_groups)
            else ""
        )
        + (
            "  swmla+r: bounded replay, never cached (a hit's last window is recomputed)"
            if scenario.prefix_replay_tokens
            else ""
        )
        + "".join(
            f"  sink: full attention beside a {g.sink_len_tokens}-token static sink "
            f"(physical blocks 1-{g.num_sink_blocks}, no request's prefix)"
            for g in scenario.kv_cache_groups
            if g.sink_len_tokens
        )
        + (
            "  * draft group (is_eagle_group)"
            if any(g.is_eagle_group for g in scenario.kv_cache_groups)
            else ""
        )
        + ("  ▒ image placeholder tokens" if images is not None else "")
    )
    lines += _block_lines(exp)
    lines += [
        f"{row.variant} crashed on request {exp.request} (blocks as cached when its lookup "
        f"started): {row.crash}"
        for row in exp.rows
        if row.crash is not None
    ]
    return "\n".join(lines) + "\n"


def _block_lines(exp: Explanation) -> list[str]:
    """Block lists handed out, per variant and group, when any row has ``wrong-kv``."""
    if not any("wrong-kv" in row.verdicts for row in exp.rows):
        return []
    lines = ["blocks handed out by the lookup (block ids; null = the null block):"]
    for row in exp.rows:
        for gid, ids in enumerate(row.lookup_blocks):
            block = exp.scenario.kv_cache_groups[gid].block_size_tokens
            lines.append(
                f"  {row.variant} g{gid}: {len(ids)} blocks for hit {row.hit_tokens} "
                f"({row.hit_tokens // block} owed) {render_blocks(ids)}"
            )
    return lines


def _svg_states(
    exp: Explanation,
    state_map: str,
    x: Callable[[int], float],
    y: int,
    row_px: int,
) -> list[str]:
    """A Mamba group's row in SVG: one diamond at each cached state's position."""
    hash_block = exp.scenario.effective_hash_block_size_tokens
    parts = [
        f'<line x1="{x(exp.start_tokens):.1f}" y1="{y + row_px / 2 - 1:.1f}" '
        f'x2="{x(exp.end_tokens):.1f}" y2="{y + row_px / 2 - 1:.1f}" stroke="#a0aec0"/>'
    ]
    for index, mark in enumerate(state_map):
        position = (index + 1) * hash_block
        if mark != "1" or not exp.start_tokens <= position <= exp.end_tokens:
            continue
        cx, cy = x(position), y + row_px / 2 - 1
        parts.append(
            f'<polygon points="{cx - 5:.1f},{cy:.1f} {cx:.1f},{cy - 6:.1f} {cx + 5:.1f},{cy:.1f} '
            f'{cx:.1f},{cy + 6:.1f}" fill="#2b6cb0"><title>state at {position}</title></polygon>'
        )
    return parts


#: Width of one character of the SVG's monospace font, per pixel of font
#: size (DejaVu Sans Mono, Menlo and Consolas are 0.60 to 0.62 em wide).
_CHAR_EM = 0.62


@dataclass
class _SvgCanvas:
    """Where token positions fall in the SVG picture, and how far right it reaches.

    Attributes:
        left: the x of the first token shown, in pixels.
        start_tokens: the first token shown.
        column_tokens: tokens per column.
        block_px: pixels per column.
        right: the right edge of everything drawn so far, in pixels; each
            text widens it to its end, measured in characters of the
            monospace font.
    """

    left: int
    start_tokens: int
    column_tokens: int
    block_px: int
    right: float

    def x(self, tokens: int) -> float:
        """The x of a token position, in pixels."""
        return self.left + (tokens - self.start_tokens) / self.column_tokens * self.block_px

    def text(self, tx: float, ty: float, content: str, *, size: int = 12, fill: str = "") -> str:
        """A ``<text>`` element at (``tx``, ``ty``) pixels; the picture widens to its end."""
        self.right = max(self.right, tx + len(content) * size * _CHAR_EM)
        colour = f' fill="{fill}"' if fill else ""
        sized = f' font-size="{size}"' if size != 12 else ""
        return f'<text x="{tx:g}" y="{ty:g}"{sized}{colour}>{escape(content, quote=False)}</text>'


def render_svg(exp: Explanation, *, block_px: int = 9, row_px: int = 22) -> str:
    """The same picture as SVG: one row per variant and group.

    The picture is as wide as its widest element: every text's width is
    measured in characters of the monospace font (the title and the legend
    were cut at a fixed right margin); an over-hit row says how much may be
    reused and the ceiling is drawn (``reusable N``) beside the expected
    checkpoint it can equal.
    """
    scenario = exp.scenario
    ref = exp.reference
    column = _column_tokens(scenario)
    width = max(1, (exp.end_tokens - exp.start_tokens) // column)
    left, top = 190, 58
    rows = [(row, gid, g) for row in exp.rows for gid, g in enumerate(scenario.kv_cache_groups)]
    block_lines = _block_lines(exp)
    block_lines += [
        f"{row.variant} crashed (blocks as cached when its lookup started): {row.crash}"
        for row in exp.rows
        if row.crash is not None
    ]
    total_h = top + len(rows) * row_px + 80 + 14 * len(block_lines)
    # The right edge starts at that of the block columns.
    canvas = _SvgCanvas(left, exp.start_tokens, column, block_px, left + width * block_px + 10.0)
    parts = [
        canvas.text(
            8,
            18,
            f"{scenario.label}: request {exp.request}, divergence {ref.divergence_tokens}, "
            f"expected {ref.expected_tokens}, dense {ref.dense_tokens}",
            size=13,
        ),
        canvas.text(
            8,
            36,
            f"tokens {exp.start_tokens}..{exp.end_tokens}; filled = SWA/full block cached "
            "when the sibling looked up",
        ),
    ]
    for index, (row, gid, group) in enumerate(rows):
        parts += _svg_group_row(exp, canvas, row, gid, group, top + index * row_px, row_px, width)
    bottom = top + len(rows) * row_px
    parts += _svg_images(exp, canvas, top, bottom)
    marks = _svg_marks(exp)
    for line, (tokens, color, label) in enumerate(marks):
        if exp.start_tokens <= tokens <= exp.end_tokens:
            x = canvas.x(tokens)
            parts.append(
                f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{bottom}" '
                f'stroke="{color}" stroke-width="1.5" stroke-dasharray="4,2"/>'
            )
            parts.append(canvas.text(x + 2, bottom + 14 * (line + 1), label, fill=color))
    total_h = max(total_h, bottom + 14 * (len(marks) + 1) + 14 * len(block_lines) + 24)
    parts += _svg_legend(exp, canvas, block_lines, total_h)
    total_w = int(canvas.right + 0.999) + 12
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
        'font-family="monospace" font-size="12">',
        f'<rect width="{total_w}" height="{total_h}" fill="white"/>',
    ]
    parts = head + parts
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _svg_group_row(
    exp: Explanation,
    canvas: _SvgCanvas,
    row: VariantRow,
    gid: int,
    group: KVCacheGroup,
    y: int,
    row_px: int,
    width: int,
) -> list[str]:
    """One variant's row for KV cache group ``gid``, ``y`` pixels down: its label,
    one box per block of ``block_size_tokens`` shown (filled when cached at
    lookup; a Mamba group's cached states instead), the variant's hit as a
    triangle, and after the last group the variant's outcome and verdict.
    ``width`` is the number of columns."""
    kind = _group_kind_label(group)
    parts = [canvas.text(8, y + 14, f"{row.variant} g{gid} {kind}{group.block_size_tokens}")]
    cache_map = row.cache_maps[gid] if gid < len(row.cache_maps) else ""
    if group.kind is GroupKind.MAMBA:
        parts.extend(_svg_states(exp, cache_map, canvas.x, y, row_px))
    first = exp.start_tokens // group.block_size_tokens
    if group.kind is GroupKind.MAMBA:
        first = -(-exp.end_tokens // group.block_size_tokens)  # states drawn above
    last = -(-exp.end_tokens // group.block_size_tokens)
    for block in range(first, last):
        cached = block < len(cache_map) and cache_map[block] == "1"
        bx = canvas.x(block * group.block_size_tokens)
        bw = group.block_size_tokens / canvas.column_tokens * canvas.block_px - 1
        parts.append(
            f'<rect x="{bx:.1f}" y="{y + 3}" width="{max(bw, 1):.1f}" height="{row_px - 8}" '
            f'fill="{"#2b6cb0" if cached else "#edf2f7"}" stroke="#a0aec0" stroke-width="0.5"/>'
        )
    hit = row.hit_tokens
    if row.crash is None and exp.start_tokens <= hit <= exp.end_tokens:
        x = canvas.x(hit)
        parts.append(
            f'<polygon points="{x - 4:.1f},{y + row_px - 2} {x + 4:.1f},'
            f'{y + row_px - 2} {x:.1f},{y + row_px - 8}" fill="#d69e2e"/>'
        )
    if gid == len(exp.scenario.kv_cache_groups) - 1:
        parts.append(
            canvas.text(
                canvas.left + width * canvas.block_px + 10, y + 14, f"{row.outcome}: {row.verdict}"
            )
        )
    return parts


def _svg_images(exp: Explanation, canvas: _SvgCanvas, top: int, bottom: int) -> list[str]:
    """The sibling's image placeholder tokens shown, shaded over every row
    (from ``top`` to ``bottom`` pixels), each titled with its identifier and
    token range."""
    parts = []
    for placed in exp.scenario.mm_placements[exp.request]:
        lo = max(placed.offset_tokens, exp.start_tokens)
        hi = min(placed.end_tokens, exp.end_tokens)
        if lo < hi:
            parts.append(
                f'<rect x="{canvas.x(lo):.1f}" y="{top - 6}" '
                f'width="{canvas.x(hi) - canvas.x(lo):.1f}" '
                f'height="{bottom - top + 6}" fill="#d69e2e" fill-opacity="0.15">'
                f"<title>image {escape(placed.identifier)} [{placed.offset_tokens}, "
                f"{placed.end_tokens})</title></rect>"
            )
    return parts


def _svg_marks(exp: Explanation) -> tuple[tuple[int, str, str], ...]:
    """The vertical marks, as (position in tokens, colour, label): the periodic
    checkpoints, the expected checkpoint, each over-hit's reusable ceiling and
    the divergence point, one label line each."""
    ref = exp.reference
    reusable = sorted({r.reusable_tokens for r in exp.rows if r.reusable_tokens is not None})
    return (
        *((c, "#718096", f"c={c}") for c in exp.checkpoints),
        (ref.expected_tokens, "#38a169", f"expected {ref.expected_tokens}"),
        *((c, "#805ad5", f"reusable {c} (over-hit above)") for c in reusable),
        (ref.divergence_tokens, "#e53e3e", f"D={ref.divergence_tokens}"),
    )


def _svg_legend(
    exp: Explanation, canvas: _SvgCanvas, block_lines: Sequence[str], total_h: int
) -> list[str]:
    """The legend at the foot of a picture ``total_h`` pixels high, with the
    block lists and crashes (``block_lines``) above it."""
    parts = [
        canvas.text(
            8,
            total_h - 8,
            "blue = cached, grey = not cached, orange triangle = the variant's hit"
            + (
                f"; shaded = {_images_text(exp)}" if exp.scenario.mm_placements[exp.request] else ""
            ),
        )
    ]
    for line, line_text in enumerate(block_lines):
        parts.append(canvas.text(8, total_h - 8 - 14 * (len(block_lines) - line), line_text))
    return parts
