"""KeyTemplate's binding without inspect (plain positional-or-keyword signatures) against
inspect's: Hypothesis over signatures and call shapes (late review)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redislock.keys import KeyTemplate, LockKeyError

OWNER = "tasks.charge"
OPTION = "lock_key"
NAMES = ("a", "b", "c", "d")
KINDS = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
)


@st.composite
def signatures(draw: Any) -> tuple[str, list[str], bool]:
    """Source of a function, the names a template may use, whether it is a bind=True run."""
    count = draw(st.integers(0, len(NAMES)))
    kinds = sorted(draw(st.lists(st.sampled_from(KINDS), min_size=count, max_size=count)))
    bound = draw(st.booleans())
    varargs, varkw = draw(st.booleans()), draw(st.booleans())
    parts: list[str] = ["self"] if bound else []
    defaulted = False
    seen_positional_only = seen_star = False
    for name, kind in zip(NAMES, kinds):
        if kind is not inspect.Parameter.POSITIONAL_ONLY and seen_positional_only:
            parts.append("/")
            seen_positional_only = False
        if kind is inspect.Parameter.KEYWORD_ONLY and not seen_star:
            parts.append("*args" if varargs else "*")
            seen_star = True
        has_default = draw(st.booleans())
        if kind is not inspect.Parameter.KEYWORD_ONLY:
            has_default = has_default or defaulted  # no non-default after a default
            defaulted = defaulted or has_default
        parts.append(f"{name}={NAMES.index(name) * 100}" if has_default else name)
        if kind is inspect.Parameter.POSITIONAL_ONLY:
            seen_positional_only = True
    if seen_positional_only:
        parts.append("/")
    if varargs and not seen_star:
        parts.append("*args")
    if varkw:
        parts.append("**kw")
    names = list(NAMES[:count])
    return f"def f({', '.join(parts)}):\n    pass\n", names, bound


calls = st.tuples(
    st.lists(st.integers(1, 9), max_size=6),
    st.dictionaries(st.sampled_from([*NAMES, "self", "zz", "args", "kw"]), st.integers(1, 9)),
)


def _template(source: str, names: list[str], bound: bool) -> tuple[KeyTemplate, Any]:
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # the generated test function
    func = namespace["f"]
    target = functools.partial(func, None) if bound else func
    spec = ":".join(f"{{{n}}}" for n in names) or "fixed"
    return KeyTemplate(spec, target, owner_name=OWNER, option=OPTION), target


def _outcome(template: KeyTemplate, args: list[int], kwargs: dict[str, int]) -> str:
    try:
        return "ok " + template.render(args, kwargs)
    except LockKeyError as exc:
        return f"error {exc}"


@settings(max_examples=400, deadline=None)
@given(signatures(), calls)
def test_binding_equals_inspects(shape: tuple[str, list[str], bool], call: Any) -> None:
    source, names, bound = shape
    args, kwargs = call
    template, target = _template(source, names, bound)
    slow, _ = _template(source, names, bound)
    slow._plain = None  # the binding before: inspect's, always
    got, want = _outcome(template, args, kwargs), _outcome(slow, args, kwargs)
    assert got == want, source
    try:
        arguments = inspect.signature(target).bind(*args, **kwargs)
    except TypeError:
        assert got.startswith("error "), source
        return
    arguments.apply_defaults()
    if names:
        assert got == "ok " + ":".join(str(arguments.arguments[n]) for n in names), source


def test_a_plain_signature_takes_the_fast_path() -> None:
    template, _ = _template("def f(self, a, b=1):\n    pass\n", ["a", "b"], True)
    assert template._plain is not None
    assert template.render((), {"a": 5}) == "5:1"
    with pytest.raises(LockKeyError, match="multiple values"):
        template.render((5,), {"a": 5})
