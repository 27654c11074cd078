"""The bisection behind scheduler mode's unreachable-block count
(``differential.driver.scheduler_mode._distinct_answers``): every distinct
value of a non-decreasing step function, with few calls."""

from __future__ import annotations

from differential.driver.scheduler_mode import _distinct_answers


def _counted(values: list[int]) -> tuple[list[int], set[int]]:
    asked: set[int] = set()

    def answer(index: int) -> int:
        asked.add(index)
        return values[index]

    return _distinct_answers(answer, len(values)), asked


def test_every_step_is_found() -> None:
    found, _ = _counted([0, 0, 0, 1, 1, 5, 5, 5, 5, 9])
    assert found == [0, 1, 5, 9]


def test_a_single_step_at_either_end() -> None:
    assert _counted([3] * 7 + [4])[0] == [3, 4]
    assert _counted([3] + [4] * 7)[0] == [3, 4]


def test_flat_answers_cost_two_lookups() -> None:
    # 512 aligned prefixes of a 16384-token prompt at alignment 32 that all
    # hit the same cached blocks: the two ends, not 512 lookups.
    found, asked = _counted([7] * 512)
    assert found == [7] and asked == {0, 511}


def test_few_steps_cost_about_k_log_n_lookups() -> None:
    values = [0] * 100 + [64] * 300 + [128] * 112
    found, asked = _counted(values)
    assert found == [0, 64, 128]
    assert len(asked) <= 2 * 2 * 10  # 2 steps, log2(512) = 9 levels, both ends


def test_no_prefix_and_one_prefix() -> None:
    assert _counted([]) == ([], set())
    assert _counted([5]) == ([5], {0})
