"""KeyTemplate: the lock_key language. Pure tests, no Redis."""

from __future__ import annotations

import ast
import decimal
import enum
import functools
import hashlib
import json
import pickle
import random
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_redislock import LockConfigurationError, RedisLockError
from celery_redislock.keys import KeyTemplate, LockKeyError

OWNER = "tasks.charge"
OPTION = "dedupe_key"  # a non-default option name, to check messages carry it


def charge(account_id: Any, amount: Any = 10, *, note: Any = None) -> None:
    pass


def one(a: Any) -> None:
    pass


def two(a: Any, b: Any) -> None:
    pass


def with_kwargs(user: Any, **extra: Any) -> None:
    pass


def bound_task(self: Any, account_id: Any) -> None:
    pass


def varargs(first: Any, *rest: Any, **options: Any) -> None:
    pass


def tmpl(spec: Any, func: Any = charge, **kw: Any) -> KeyTemplate:
    kw.setdefault("owner_name", OWNER)
    kw.setdefault("option", OPTION)
    return KeyTemplate(spec, func, **kw)


def key_of(value: Any) -> str:
    return tmpl("{a}", one).render((value,), {})


def config_error(spec: Any, func: Any = charge, **kw: Any) -> str:
    with pytest.raises(LockConfigurationError) as info:
        tmpl(spec, func, **kw)
    message = str(info.value)
    assert OWNER in message
    assert OPTION in message
    return message


def key_error(template: KeyTemplate, args: Any, kwargs: Any) -> LockKeyError:
    with pytest.raises(LockKeyError) as info:
        template.render(args, kwargs)
    error = info.value
    assert OWNER in str(error)
    assert OPTION in str(error)
    assert error.owner == OWNER
    assert error.option == OPTION
    return error


class User:
    def __init__(self, id: Any) -> None:
        self.id = id


# --------------------------------------------------------------------- exception types


def test_exception_tree() -> None:
    assert issubclass(LockConfigurationError, ValueError)
    assert issubclass(LockConfigurationError, RedisLockError)
    assert issubclass(LockKeyError, RedisLockError)
    assert issubclass(LockKeyError, ValueError)
    assert not issubclass(LockKeyError, LockConfigurationError)


def test_lock_key_error_pickles_with_its_attributes() -> None:
    error = key_error(tmpl("{user.id}", with_kwargs), (object(),), {})
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is LockKeyError
    assert str(copy) == str(error)
    assert (copy.owner, copy.option, copy.placeholder) == (OWNER, OPTION, "{user.id}")


def test_core_module_imports_only_stdlib_and_errors() -> None:
    import celery_redislock._keyvalues as values
    import celery_redislock.keys as module

    # The template language (keys.py) and its values' written forms (_keyvalues.py).
    for checked, allowed in ((module, {"_errors", "_keyvalues"}), (values, set())):
        tree = ast.parse(Path(checked.__file__ or "").read_text(encoding="utf-8"))
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.module in allowed, (checked.__name__, node.module)
                else:
                    imported.add((node.module or "").split(".")[0])
        assert "celery" not in imported
        assert "kombu" not in imported
        stdlib = getattr(sys, "stdlib_module_names", None)
        if stdlib is not None:
            assert imported <= set(stdlib) | {"__future__"}, checked.__name__


# --------------------------------------------------------------------- rendering


def test_call_forms_render_the_same_key() -> None:
    t = tmpl("account:{account_id}:{amount}")
    keys = {
        t.render((7, 10), {}),
        t.render((), {"account_id": 7, "amount": 10}),
        t.render((7,), {"amount": 10}),
        t.render((7,), {}),  # default applied
        t.render((), {"account_id": 7}),
    }
    assert keys == {"account:7:10"}
    assert t.render((7, 11), {}) == "account:7:11"


def test_keyword_only_default_applied() -> None:
    t = tmpl("{account_id}:{note}")
    assert t.render((1,), {}) == t.render((1,), {"note": None}) == "1:~none"
    assert t.render((1,), {"note": "x"}) == "1:x"


def test_fields_lists_roots_once_in_order() -> None:
    assert tmpl("{amount}:{account_id}:{amount}").fields == ("amount", "account_id")
    assert tmpl("{account_id.id}:{account_id[x]}").fields == ("account_id",)
    assert tmpl("fixed").fields == ()
    assert tmpl(None).fields == ()
    assert tmpl(lambda a, k: "x").fields == ()


def test_fixed_template() -> None:
    t = tmpl("nightly-report")
    assert t.render((1,), {}) == "nightly-report"
    assert t.render((), {"account_id": 2, "amount": 3}) == "nightly-report"


def test_literal_text_kept_and_escaped_braces() -> None:
    t = tmpl("a b/é{{x}}:{account_id}")
    assert t.render(("v w",), {}) == "a b/é{x}:v%20w"


def test_nested_attribute_and_items() -> None:
    def f(user: Any, data: Any) -> None:
        pass

    t = tmpl("{user.id}:{data[key]}:{data[0]}", f)
    assert t.render((User(5), {"key": "k", 0: "zero"}), {}) == "5:k:zero"
    # an all-digit item key is an int index, as in str.format
    t2 = tmpl("{data[0]}:{data[1].id}", f)
    assert t2.render((None, ["first", User("x")]), {}) == "first:x"
    t3 = tmpl("{user.id.real}:{data[a b][-1]}", f)
    assert t3.render((User(3), {"a b": {"-1": "m"}}), {}) == "3:m"


def test_var_positional_and_var_keyword_parameters_are_roots() -> None:
    t = tmpl("{first}:{rest}:{options}", varargs)
    assert t.render((1,), {}) == "1:~j%28%29:~j%7B%7D"  # () and {}
    assert t.render((1, 2), {"x": 3}) == "1:~j%282%29:~j%7B%22x%22%3A3%7D"
    t2 = tmpl("{rest[0]}", varargs)
    assert t2.render((1, "a"), {}) == "a"


def test_kwargs_function_allows_unknown_roots() -> None:
    t = tmpl("{user}:{tenant}", with_kwargs)
    assert t.fields == ("user", "tenant")
    assert t.render(("u",), {"tenant": "t"}) == t.render((), {"user": "u", "tenant": "t"}) == "u:t"
    error = key_error(t, ("u",), {})
    assert error.placeholder == "{tenant}"
    assert "{tenant}" in str(error)


def test_leading_self_is_skipped() -> None:
    t = tmpl("account:{account_id}", bound_task)
    assert t.render((7,), {}) == t.render((), {"account_id": 7}) == "account:7"
    message = config_error("{self.name}", bound_task)
    assert "{self.name}" in message
    assert "account_id" in message


def test_self_is_skipped_even_with_kwargs() -> None:
    def f(self: Any, **kw: Any) -> None:
        pass

    config_error("{self}", f)
    assert tmpl("{x}", f).render((), {"x": 1}) == "1"


def test_bound_method_signature_used_as_given() -> None:
    class Service:
        def run(self, account_id: Any) -> None:
            pass

    t = tmpl("{account_id}", Service().run)
    assert t.render((3,), {}) == "3"


def test_partial_signature() -> None:
    t = tmpl("{account_id}", functools.partial(bound_task, None))
    assert t.render((3,), {}) == t.render((), {"account_id": 3}) == "3"
    message = config_error("{acount_id}", functools.partial(bound_task, None))
    assert "bound_task" in message
    assert "functools.partial" not in message


def test_singleton_when_spec_is_none() -> None:
    t = tmpl(None)
    assert t.render((), {}) == OWNER
    assert t.render((1, 2, 3), {"anything": object()}) == OWNER


def test_callable_spec() -> None:
    calls: list[tuple[Any, Any]] = []

    def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        calls.append((args, kwargs))
        return f"acct-{args[0]}"

    t = tmpl(key)
    assert t.render([7], {"amount": 1}) == "acct-7"
    assert calls == [((7,), {"amount": 1})]
    assert type(calls[0][0]) is tuple
    assert type(calls[0][1]) is dict


@pytest.mark.parametrize("result", ["", None, 7, b"x"])
def test_callable_must_return_non_empty_str(result: Any) -> None:
    error = key_error(tmpl(lambda a, k: result), (), {})
    assert "non-empty str" in str(error)


def test_callable_exception_is_chained() -> None:
    def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        raise KeyError("nope")

    error = key_error(tmpl(key), (), {})
    assert isinstance(error.__cause__, KeyError)


def plain(a: Any, b: Any = 2, c: Any = 3) -> None:
    pass


def test_plain_signature_binds_as_inspect_does() -> None:
    """A function of plain parameters is bound without inspect: every call form (good
    and bad) renders what inspect's binding renders, or fails with its error."""
    import inspect
    import itertools

    t = KeyTemplate("{a}/{b}/{c}", plain, owner_name=OWNER, option=OPTION)
    assert t._plain is not None  # the fast path is the one under test
    signature = inspect.signature(plain)
    names = ("a", "b", "c", "zz")
    forms = 0
    for count in range(5):
        args = tuple(range(10, 10 + count))
        for used in itertools.chain.from_iterable(
            itertools.combinations(names, n) for n in range(len(names) + 1)
        ):
            kwargs = {name: f"k{name}" for name in used}
            forms += 1
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                assert str(exc) in str(key_error(t, args, kwargs))
                continue
            bound.apply_defaults()
            want = "/".join(str(bound.arguments[n]) for n in ("a", "b", "c"))
            assert t.render(args, kwargs) == want
    assert forms == 5 * 16


# --------------------------------------------------------------------- render errors


def test_binding_failures_name_the_argument() -> None:
    t = tmpl("{account_id}")
    assert "'account_id'" in str(key_error(t, (), {}))
    assert "too many positional" in str(key_error(t, (1, 2, 3), {}))
    assert "'bogus'" in str(key_error(t, (1,), {"bogus": 1}))
    assert "'account_id'" in str(key_error(t, (1,), {"account_id": 1}))


def test_fixed_template_still_checks_the_call() -> None:
    key_error(tmpl("fixed"), (), {})


def test_attribute_lookup_failure_names_placeholder() -> None:
    error = key_error(tmpl("{account_id.id}"), (object(),), {})
    assert "{account_id.id}" in str(error)
    assert error.placeholder == "{account_id.id}"
    assert isinstance(error.__cause__, AttributeError)


@pytest.mark.parametrize("value", [{}, [], None, 5])
def test_item_lookup_failure_names_placeholder(value: Any) -> None:
    error = key_error(tmpl("{account_id[key]}:{amount}"), (value,), {})
    assert "{account_id[key]}" in str(error)
    assert error.placeholder == "{account_id[key]}"


def test_index_out_of_range() -> None:
    error = key_error(tmpl("{account_id[3]}"), ([1],), {})
    assert isinstance(error.__cause__, IndexError)


@pytest.mark.parametrize(
    ("value", "type_name"),
    [({1, 2}, "set"), (object(), "object"), ([1, {2}], "set"), ({"a": User(1)}, "User")],
)
def test_unencodable_value(value: Any, type_name: str) -> None:
    error = key_error(tmpl("{account_id}"), (value,), {})
    message = str(error)
    assert "{account_id}" in message
    assert type_name in message
    assert "{account_id.id}" in message  # suggests an attribute
    assert "callable" in message


def test_circular_structure() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    error = key_error(tmpl("{account_id}"), (loop,), {})
    assert "circular" in str(error)


def test_huge_int_is_a_key_error_not_a_crash() -> None:
    if not hasattr(sys, "get_int_max_str_digits") or not sys.get_int_max_str_digits():
        pytest.skip("no int string limit on this interpreter")
    key_error(tmpl("{account_id}"), (10 ** (sys.get_int_max_str_digits() + 1),), {})


# --------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize("spec", [5, b"account:{x}", ["{account_id}"], 1.5, True])
def test_spec_of_wrong_type(spec: Any) -> None:
    message = config_error(spec)
    assert "None" in message
    assert "callable" in message


def test_empty_template() -> None:
    config_error("")


def test_unknown_parameter_lists_the_real_ones() -> None:
    message = config_error("account:{acount_id}")
    assert "{acount_id}" in message
    assert "account_id, amount, note" in message


def test_unknown_parameter_of_function_without_parameters() -> None:
    def nothing() -> None:
        pass

    assert "none" in config_error("{x}", nothing)


@pytest.mark.parametrize("spec", ["{}", "{0}", "a:{0.id}", "{[0]}", "{account_id}:{}"])
def test_positional_fields_rejected(spec: str) -> None:
    assert "positional" in config_error(spec)


@pytest.mark.parametrize(
    "spec", ["{account_id!r}", "{account_id!s}", "{account_id:>3}", "{account_id:{amount}}"]
)
def test_conversion_and_format_spec_rejected(spec: str) -> None:
    assert "canonical" in config_error(spec)


@pytest.mark.parametrize(
    "spec", ["{account_id", "account_id}", "{account_id.}", "{account_id[}", "{account_id[x]y}"]
)
def test_malformed_template(spec: str) -> None:
    config_error(spec)


@pytest.mark.parametrize("between", ["", "-", "_", ".", "%", "~", "'", "ab9", "-x-"])
def test_adjacent_fields_need_a_separator(between: str) -> None:
    message = config_error("{account_id}" + between + "{amount}")
    assert "separated" in message


@pytest.mark.parametrize("between", [":", "/", " ", "|", "é", "a:b", "{{"])
def test_separators_accepted(between: str) -> None:
    tmpl("x{account_id}" + between + "{amount}y")


def test_owner_name_must_be_non_empty() -> None:
    with pytest.raises(LockConfigurationError):
        KeyTemplate(None, charge, owner_name="")


def test_uninspectable_function() -> None:
    def f() -> None:
        pass

    f.__signature__ = "not a signature"  # type: ignore[attr-defined]
    config_error("{x}", f)


class _Probe:
    """Records every attribute/item lookup made on it or on probes it returns."""

    def __init__(self, log: list[tuple[bool, Any]]) -> None:
        self._log = log

    def __getattr__(self, attr: str) -> _Probe:
        self._log.append((True, attr))
        return _Probe(self._log)

    def __getitem__(self, item: Any) -> _Probe:
        self._log.append((False, item))
        return _Probe(self._log)


@pytest.mark.parametrize(
    "name", ["a", "a.b", "a[0]", "a[b]", "a[-1]", "a[0][1].c", "a[b.c]", "a[ ]", "a[١٢]"]
)
def test_field_lookups_match_str_format(name: str) -> None:
    expected: list[tuple[bool, Any]] = []
    ("{" + name + "}").format(a=_Probe(expected))
    seen: list[tuple[bool, Any]] = []
    with pytest.raises(LockKeyError):  # a probe has no key form, but the path is walked
        tmpl("{" + name + "}", one).render((_Probe(seen),), {})
    assert seen == expected
    assert [type(key) for _, key in seen] == [type(key) for _, key in expected]


# --------------------------------------------------------------------- value encoding


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("alice", "alice"),
        ("A-z_0.9", "A-z_0.9"),
        ("7", "'7"),
        ("-3", "'-3"),
        ("007", "'007"),
        ("", "'"),
        ("-", "-"),
        ("a:b", "a%3Ab"),
        ("~", "%7E"),
        ("'", "%27"),
        ("%", "%25"),
        (" ", "%20"),
        ("é", "%C3%A9"),
        ("\ud800", "%ED%A0%80"),  # lone surrogate: surrogatepass, still one-to-one
        (7, "7"),
        (-3, "-3"),
        (0, "0"),
        (True, "~true"),
        (False, "~false"),
        (None, "~none"),
        (1.0, "~f1.0"),
        (-0.0, "~f-0.0"),
        (1e100, "~f1e%2B100"),
        (float("inf"), "~finf"),
        (float("nan"), "~fnan"),
        (uuid.UUID(int=1), "~u00000000-0000-0000-0000-000000000001"),
        (decimal.Decimal("1.50"), "~d1.50"),
        (decimal.Decimal("1E+2"), "~d1E%2B2"),
        (b"\x01\xff", "~b01ff"),
        (bytearray(b"1"), "~b31"),
        ([1], "~j%5B1%5D"),
        ((1,), "~j%281%29"),
        ({"a": 1}, "~j%7B%22a%22%3A1%7D"),
    ],
)
def test_value_encoding(value: Any, expected: str) -> None:
    assert key_of(value) == expected


def test_str_and_int_subclasses_encode_as_their_value() -> None:
    class Color(str, enum.Enum):
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    assert key_of(Color.RED) == key_of("red")
    assert key_of(Level.HIGH) == key_of(3)
    assert key_of([Color.RED, Level.HIGH]) == key_of(["red", 3])


def test_json_form_is_canonical_json_for_json_data() -> None:
    from urllib.parse import unquote

    value = {"b": [1, 2.5, None, True, 'é\n"'], "a": {"z": 1, "y": {}}, "é": []}
    encoded = key_of(value)
    assert encoded.startswith("~j")
    expected = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert unquote(encoded[2:]) == expected


def test_dict_order_does_not_matter() -> None:
    assert key_of({"a": 1, "b": 2}) == key_of({"b": 2, "a": 1})
    assert key_of({1: "x", "1": "y", None: 0}) == key_of({None: 0, "1": "y", 1: "x"})


def test_encoded_values_use_only_the_value_alphabet() -> None:
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-%~'")
    for value in DISTINCT_VALUES:
        assert set(key_of(value)) <= alphabet, value


DISTINCT_VALUES: list[Any] = [
    0,
    1,
    -1,
    7,
    10,
    "0",
    "1",
    "-1",
    "7",
    "07",
    "1.0",
    "",
    " ",
    "a",
    "A",
    "a:b",
    "a%3Ab",
    "%",
    "%25",
    "~",
    "~true",
    "~none",
    "~f1.0",
    "'",
    "'1",
    "''",
    "true",
    "none",
    "null",
    "é",
    "%C3%A9",
    None,
    True,
    False,
    1.0,
    -0.0,
    0.0,
    float("inf"),
    1e100,
    uuid.UUID(int=1),
    "00000000-0000-0000-0000-000000000001",
    decimal.Decimal("1"),
    decimal.Decimal("1.0"),
    b"",
    b"1",
    "31",
    [],
    (),
    {},
    [1],
    (1,),
    ["1"],
    [1.0],
    [True],
    [None],
    [[1]],
    [(1,)],
    ((1,),),
    {"a": 1},
    {"a": "1"},
    {1: 1},
    {"1": 1},
    {True: 1},
    {None: 1},
    {"null": 1},
    {(1,): 1},
    {"a": [1]},
    {"a": (1,)},
    [1, 2],
    ["1,2"],
    [[1, 2]],
    [[1], 2],
]


def test_distinct_values_render_distinct_keys() -> None:
    keys = [key_of(value) for value in DISTINCT_VALUES]
    duplicates = {k for k in keys if keys.count(k) > 1}
    assert not duplicates, [(v, key_of(v)) for v in DISTINCT_VALUES if key_of(v) in duplicates]


def test_two_fields_do_not_collide() -> None:
    t = tmpl("{a}:{b}", two)
    assert t.render(("1:2", "3"), {}) != t.render(("1", "2:3"), {})
    assert t.render(("1:2", "3"), {}) == "1%3A2:'3"
    assert t.render(("1", "2:3"), {}) == "'1:2%3A3"


def test_random_argument_pairs_are_injective() -> None:
    rng = random.Random(1234)
    atoms: list[Any] = [*DISTINCT_VALUES, ":", "a:", ":b", "1:", ":1", "::"]
    # inside lists/tuples only JSON-like values have a key form
    nestable = [v for v in atoms if not isinstance(v, (bytes, uuid.UUID, decimal.Decimal))]

    def random_value(depth: int = 0) -> Any:
        kind = rng.random()
        if depth < 2 and kind < 0.15:
            return [random_value(depth + 1) for _ in range(rng.randrange(3))]
        if depth < 2 and kind < 0.25:
            return tuple(random_value(depth + 1) for _ in range(rng.randrange(3)))
        if kind < 0.5:
            return "".join(rng.choice("a1:%~'-. é") for _ in range(rng.randrange(4)))
        return rng.choice(nestable if depth else atoms)

    for spec in ["{a}:{b}", "x:{a}::{b}:y", "{a} {b}"]:
        t = tmpl(spec, two)
        seen: dict[str, Any] = {}
        for _ in range(3000):
            pair = (random_value(), random_value())
            key = t.render(pair, {})
            canonical = (key_of(pair[0]), key_of(pair[1]))  # the per-value forms
            assert seen.setdefault(key, canonical) == canonical, (spec, pair)


# --------------------------------------------------------------------- hashed keys


def test_hashed_key_hides_values_and_is_stable() -> None:
    t = tmpl("account:{account_id}:{amount}", hashed=True)
    plain = tmpl("account:{account_id}:{amount}")
    key = t.render(("alice@example.com",), {})
    assert "alice" not in key
    assert "example" not in key
    rendered = plain.render(("alice@example.com",), {})
    digest = hashlib.sha256(rendered.encode()).hexdigest()[:32]
    assert key == f"account:#{digest}"
    # stable: the same for every call form and a fresh template
    again = tmpl("account:{account_id}:{amount}", hashed=True)
    assert again.render((), {"account_id": "alice@example.com", "amount": 10}) == key
    assert t.render(("bob@example.com",), {}) != key


def test_hashed_prefix_falls_back_to_owner() -> None:
    key = tmpl("{account_id}:x", hashed=True).render((1,), {})
    assert key.startswith(OWNER + ":#")
    assert len(key) == len(OWNER) + 2 + 32
    assert tmpl(lambda a, k: "secret", hashed=True).render((), {}).startswith(OWNER + ":#")
    assert "secret" not in tmpl(lambda a, k: "secret", hashed=True).render((), {})
    assert tmpl(None, hashed=True).render((), {}).startswith(OWNER + ":#")


def test_hashed_errors_are_still_raised() -> None:
    key_error(tmpl("{account_id}", hashed=True), (), {})


def test_repr() -> None:
    assert repr(tmpl("a:{account_id}", hashed=True)) == (
        f"KeyTemplate('a:{{account_id}}', owner_name='{OWNER}', hashed=True)"
    )
