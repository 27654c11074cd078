"""Scheduler mode's argument binder (``differential.driver.scheduler_mode._binder``)
answers as ``inspect.Signature.bind`` with ``apply_defaults`` does, on vLLM's
own ``KVCacheManager.allocate_slots`` and on plain functions."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from differential.driver.scheduler_mode import _binder


def _inspected(function: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    call = inspect.signature(function).bind(*args, **kwargs)
    call.apply_defaults()
    return dict(call.arguments)


def test_allocate_slots_calls_bind_as_inspect_does() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    # Unbound, with ``self`` first: every parameter of the real method.
    method = KVCacheManager.allocate_slots
    bind = _binder(method)
    request, blocks = object(), object()
    for args, kwargs in (
        (("manager", request, 16), {}),
        (("manager", request, 16), {"num_new_computed_tokens": 32, "new_computed_blocks": blocks}),
        (("manager",), {"request": request, "num_new_tokens": 1, "num_lookahead_tokens": 3}),
    ):
        given = bind(*args, **kwargs)
        assert given == _inspected(method, *args, **kwargs)
        assert given["request"] is request


def test_defaults_positional_and_keyword() -> None:
    def f(a: int, b: int = 2, *, c: int = 3) -> None: ...

    bind = _binder(f)
    assert bind(1) == {"a": 1, "b": 2, "c": 3}
    assert bind(1, 5, c=7) == {"a": 1, "b": 5, "c": 7}
    assert bind(b=4, a=0) == {"a": 0, "b": 4, "c": 3}


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 2, 3), {}), ((1,), {"d": 4}), ((1,), {"a": 2})],
    ids=["too-many-positional", "unknown-keyword", "given-twice"],
)
def test_arguments_that_do_not_fit_raise_type_error(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    def f(a: int, b: int = 2, *, c: int = 3) -> None: ...

    with pytest.raises(TypeError):
        inspect.signature(f).bind(*args, **kwargs)
    with pytest.raises(TypeError):
        _binder(f)(*args, **kwargs)


def test_star_arguments_fall_back_to_inspect() -> None:
    def wrapper(*args: Any, **kwargs: Any) -> None: ...

    assert _binder(wrapper)(1, x=2) == {"args": (1,), "kwargs": {"x": 2}}
