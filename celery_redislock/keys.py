"""Lock-key templates: turn a function's call arguments into a lock name.

A task's ``lock_key`` option says which calls exclude each other. It is one of:

``None``
    One lock per task (a singleton): every call renders the owner's name.

a template string
    ``str.format`` field syntax over the function's *parameter names*::

        "account:{account_id}"        a parameter
        "user:{user.id}"              an attribute of a parameter
        "doc:{data[key]}"             an item (``data["key"]``)
        "row:{rows[0]}"               an item with an int index (all-digit keys, as str.format)
        "pair:{src}:{dst}"            several parameters
        "nightly-report"              no fields: one fixed key

    Arguments are bound to the real signature with defaults applied, so ``f(7, 10)``,
    ``f(7, amount=10)`` and ``f(account_id=7, amount=10)`` render the same key. When the
    function takes ``**kwargs``, a name that is not a parameter is looked up there.

a callable
    ``spec(args_tuple, kwargs_dict) -> str``, for anything a template cannot say. Its
    result is used verbatim, so keeping it collision-free is up to the callable.

Values are written in a canonical, typed form, so *different* argument values never
render the same key and a key never depends on how an argument was passed:

==========================  ==========================================================
value                       written as
==========================  ==========================================================
``str``                     UTF-8 bytes outside ``A-Z a-z 0-9 _ . -`` as ``%XX``;
                            prefixed with ``'`` if empty or it would look like an int
                            (``"alice"`` → ``alice``, ``"7"`` → ``'7``, ``"a:b"`` → ``a%3Ab``)
``int``                     decimal (``7``, ``-3``)
``bool`` / ``None``         ``~true``, ``~false``, ``~none``
``float``                   ``~f`` + ``repr`` (``~f1.0``, ``1e+100`` → ``~f1e%2B100``)
``uuid.UUID``               ``~u`` + canonical hex form
``decimal.Decimal``         ``~d`` + ``str``, ``+`` as ``%2B`` (``1.0`` and ``1.00`` differ)
``bytes`` / ``bytearray``   ``~b`` + hex
``list`` / ``tuple`` /      ``~j`` + canonical JSON (sorted keys, no spaces), ``%``-encoded;
``dict``                    tuples are written ``(…)``, non-``str`` dict keys keep their type;
                            items must be of these JSON-like types themselves
==========================  ==========================================================

Anything else (sets, datetimes, your own classes) is refused at render time: name an
attribute (``{order.id}``) or use a callable. ``1``, ``1.0``, ``True`` and ``"1"`` give
four different keys; convert before calling if they must share a lock. Likewise a
tuple and a list differ, and Celery's JSON serializer turns tuples into lists: a key
rendered before sending and one rendered in the worker only agree for lists.

Literal text of the template is kept as is. Two placeholders must be separated by at
least one character that never occurs in a written value (anything but ASCII letters,
digits and ``_ . - % ~ '``; ``:`` is the usual choice), so ``"{a}:{b}"`` is accepted and
``"{a}{b}"`` or ``"{a}-{b}"`` are refused: with them ``("x-y", "z")`` and ``("x", "y-z")``
would share a key.

With ``hashed=True`` the key becomes ``<prefix>#<32 hex digits of SHA-256 of the key>``,
where the prefix is the template's literal text before its first placeholder (or the
owner's name and ``:`` when there is none, and for callables and ``None``). This keeps
personal data (e-mail addresses, names) out of Redis key names, ``MONITOR`` output and
logs, while equal calls still share one lock.

Mistakes in the template are :class:`~celery_redislock.LockConfigurationError` when the
template is built; calls that cannot be rendered raise :class:`LockKeyError`.

This module parses templates and renders calls; the values' written forms above are
:mod:`celery_redislock._keyvalues`'s.
"""

from __future__ import annotations

import hashlib
import inspect
import string
from typing import Any, Callable, Mapping, NamedTuple, Sequence, Union, cast

from ._errors import LockConfigurationError, RedisLockError
from ._keyvalues import _VALUE_ALPHABET, _encode, _Unencodable

#: A callable lock key: ``(args, kwargs) -> key``.
KeyFunction = Callable[[tuple[Any, ...], dict[str, Any]], str]

_Step = tuple[bool, Union[str, int]]  # (is attribute, attribute name or item key)


class LockKeyError(RedisLockError, ValueError):
    """A call's arguments could not be turned into a lock key.

    Raised at render time (the template itself was valid). The message names the
    owner (task), the option and, where one is at fault, the placeholder.

    Attributes:
        owner: Name of the task or function whose key failed, if known.
        option: The option holding the template (``"lock_key"`` by default).
        placeholder: The placeholder that failed, e.g. ``"{user.id}"``, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        owner: str | None = None,
        option: str | None = None,
        placeholder: str | None = None,
    ) -> None:
        super().__init__(message)
        self.owner = owner
        self.option = option
        self.placeholder = placeholder

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the keyword-only attributes across pickling (result backends pickle errors).
        return (type(self), self.args, self.__dict__)


# --------------------------------------------------------------------- template parsing


class _Field(NamedTuple):
    placeholder: str  # "{user.id}", for messages
    root: str  # "user"
    steps: tuple[_Step, ...]  # ((True, "id"),)
    is_param: bool  # False: looked up in the function's **kwargs


def _split_field(name: str) -> tuple[str, tuple[_Step, ...]]:
    """Split a field name the way ``str.format`` does: root, then ``.attr``/``[key]`` steps.

    An item key made only of decimal digits becomes an int, as in ``str.format``.

    Raises:
        ValueError: the field name is malformed.
    """
    size = len(name)
    i = 0
    while i < size and name[i] not in ".[":
        i += 1
    root = name[:i]
    steps: list[_Step] = []
    while i < size:
        if name[i] == ".":
            start = i = i + 1
            while i < size and name[i] not in ".[":
                i += 1
            if start == i:
                raise ValueError("empty attribute name after '.'")
            steps.append((True, name[start:i]))
        else:  # "["
            end = name.find("]", i + 1)
            if end < 0:
                raise ValueError("missing ']'")
            key = name[i + 1 : end]
            if not key:
                raise ValueError("empty item key '[]'")
            steps.append((False, int(key) if key.isdecimal() else key))
            i = end + 1
            if i < size and name[i] not in ".[":
                raise ValueError("only '.' or '[' may follow ']'")
    return root, tuple(steps)


def _describe(spec: object) -> str:
    if isinstance(spec, str):
        return repr(spec)
    return getattr(spec, "__qualname__", None) or repr(spec)


class KeyTemplate:
    """A parsed ``lock_key``: renders call arguments into a lock name.

    The template is parsed and checked once, here; :meth:`render` does no parsing and
    keeps no state, so one instance may be shared by any number of threads.

    Args:
        spec: ``None`` (one lock per owner), a template string, or a callable
            ``(args_tuple, kwargs_dict) -> str``. See the module documentation.
        func: The function whose calls are keyed. Template placeholders must name its
            parameters; a leading positional parameter literally named ``self`` (the task
            of a ``bind=True`` task) is skipped and is not part of the call.
        owner_name: Name used in messages, as the key of a ``None`` spec and as the hashed
            key's fallback prefix (normally the task name). Must be a non-empty str.
        option: Name of the option the spec came from, used in messages.
        hashed: Render ``<prefix>#<sha256 hex[:32]>`` instead of the readable key.

    Raises:
        LockConfigurationError: ``spec`` is not None/str/callable, the template is empty or
            malformed, uses positional fields, conversions or format specs, names a
            parameter ``func`` does not have (unless ``func`` takes ``**kwargs``), or puts
            two placeholders next to each other without a separating character; or a
            template was given and ``func`` has no inspectable signature.

    Attributes:
        fields: Root parameter names the template uses, in order of first use, without
            repeats (empty for callables, ``None`` and fixed templates).
    """

    __slots__ = (
        "_defaults",
        "_func_shown",
        "_hash_prefix",
        "_max_positional",
        "_parts",
        "_plain",
        "_render",
        "_signature",
        "_varkw",
        "_where",
        "fields",
        "hashed",
        "option",
        "owner_name",
        "spec",
    )

    def __init__(
        self,
        spec: str | KeyFunction | None,
        func: Callable[..., Any],
        *,
        owner_name: str,
        option: str = "lock_key",
        hashed: bool = False,
    ) -> None:
        if not isinstance(owner_name, str) or not owner_name:
            raise LockConfigurationError(f"owner_name must be a non-empty str, got {owner_name!r}")
        self.spec = spec
        self.owner_name = owner_name
        self.option = option
        self.hashed = bool(hashed)
        self.fields: tuple[str, ...] = ()
        self._where = f"{owner_name}: {option}={_describe(spec)}"
        self._parts: tuple[str | _Field, ...] = ()
        self._defaults: dict[str, Any] = {}
        self._varkw: str | None = None
        self._signature: inspect.Signature | None = None
        #: (parameter names, the names without a default) when every parameter is a plain
        #: positional-or-keyword one: calls are then bound without inspect (same result).
        self._plain: tuple[tuple[str, ...], frozenset[str], frozenset[str]] | None = None
        self._func_shown = ""
        self._max_positional = ""
        self._hash_prefix = owner_name + ":"
        self._render: Callable[[Sequence[Any], Mapping[str, Any]], str]
        if spec is None:
            self._render = self._render_singleton
        elif isinstance(spec, str):
            self._parse(spec, func)
            self._render = self._render_template
        elif callable(spec):
            self._render = self._render_callable
        else:
            raise LockConfigurationError(
                f"{owner_name}: {option} must be None (one lock per task), a template str "
                f"such as 'account:{{account_id}}', or a callable (args, kwargs) -> str; "
                f"got a {type(spec).__qualname__}: {spec!r}"
            )

    # ----------------------------------------------------------------- construction

    def _fail(self, why: str) -> LockConfigurationError:
        return LockConfigurationError(f"{self._where}: {why}")

    def _parse(self, spec: str, func: Callable[..., Any]) -> None:
        if not spec:
            raise self._fail("the template is empty; use None for one lock per task")
        try:
            parsed = list(string.Formatter().parse(spec))
        except ValueError as exc:
            raise self._fail(
                f"malformed template ({exc}); write literal braces as '{{{{' and '}}}}'"
            ) from exc
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError) as exc:
            raise self._fail(f"cannot read the signature of {func!r}: {exc}") from exc
        params = list(signature.parameters.values())
        skipped_self = bool(
            params
            and params[0].name == "self"
            and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)
        )
        if skipped_self:
            params = params[1:]
            signature = signature.replace(parameters=params)
        by_name = {p.name: p for p in params}
        self._varkw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        named = getattr(func, "func", func)  # functools.partial: name the wrapped function
        func_name = getattr(named, "__qualname__", None) or repr(func)

        parts: list[str | _Field] = []
        fields: list[str] = []
        previous: _Field | None = None
        pending_literal = ""
        for literal, name, format_spec, conversion in parsed:
            pending_literal += literal
            if name is None:
                continue
            shown = "{" + name + ("!" + conversion if conversion else "")
            shown += (":" + format_spec if format_spec else "") + "}"
            if conversion or format_spec:
                raise self._fail(
                    f"placeholder {shown} has a conversion or format spec; they are not "
                    f"allowed because keys must be canonical (each value is written in one "
                    f"typed form, so equal arguments always share a key): write {{{name}}}"
                )
            try:
                root, steps = _split_field(name)
            except ValueError as exc:
                raise self._fail(f"malformed placeholder {shown}: {exc}") from exc
            if not root or root.isdecimal():
                raise self._fail(
                    f"positional placeholder {shown} is not allowed: name the parameter "
                    f"instead (e.g. {{{next(iter(by_name), 'account_id')}}}), so the key does "
                    f"not depend on how the argument is passed"
                )
            if root not in by_name and (self._varkw is None or (root == "self" and skipped_self)):
                existing = ", ".join(by_name) if by_name else "none"
                hint = (
                    " (the leading 'self' parameter is the bound task, not a call argument)"
                    if root == "self" and skipped_self
                    else ""
                )
                raise self._fail(
                    f"placeholder {shown} names no parameter of {func_name}{hint}; "
                    f"its parameters are: {existing}"
                )
            if previous is not None and not (set(pending_literal) - _VALUE_ALPHABET):
                raise self._fail(
                    f"placeholders {previous.placeholder} and {shown} must be separated by a "
                    f"character other than ASCII letters, digits and _ . - % ~ ' (e.g. ':'); "
                    f"otherwise different arguments could render the same key"
                )
            if not parts and pending_literal:
                self._hash_prefix = pending_literal
            if pending_literal:
                parts.append(pending_literal)
            pending_literal = ""
            field = _Field(shown, root, steps, root in by_name)
            parts.append(field)
            previous = field
            if root not in fields:
                fields.append(root)
        if pending_literal:
            parts.append(pending_literal)

        defaults: dict[str, Any] = {}
        for p in params:
            if p.kind is p.VAR_POSITIONAL:
                defaults[p.name] = ()
            elif p.kind is p.VAR_KEYWORD:
                defaults[p.name] = {}
            elif p.default is not p.empty:
                defaults[p.name] = p.default
        self._defaults = defaults
        self._signature = signature
        if all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params):
            names = tuple(p.name for p in params)
            required = frozenset(p.name for p in params if p.default is p.empty)
            self._plain = (names, frozenset(names), required)
        self._parts = tuple(parts)
        self.fields = tuple(fields)
        self._func_shown = f"{func_name}{signature}"
        if not any(p.kind is p.VAR_POSITIONAL for p in params):
            count = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
            self._max_positional = f", at most {count} accepted"

    # ----------------------------------------------------------------- rendering

    def render(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """Render the lock name for one call.

        Guarantees: calls that bind to the same parameter values (however the arguments
        were passed, defaults included) render the same key; for a template, calls whose
        used values differ render different keys (for ``hashed``, up to SHA-256 collisions
        of 128 bits). The result is a non-empty str.

        Args:
            args: Positional call arguments (without the bound task's ``self``).
            kwargs: Keyword call arguments.

        Returns:
            The lock name.

        Raises:
            LockKeyError: the arguments do not fit the function's signature, a placeholder
                cannot be resolved or its value has no canonical form, or a callable spec
                failed or did not return a non-empty str.
        """
        key = self._render(args, kwargs)
        if self.hashed:
            digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
            return f"{self._hash_prefix}#{digest[:32]}"
        return key

    def _error(self, why: str, placeholder: str | None = None) -> LockKeyError:
        return LockKeyError(
            f"{self._where}: {why}",
            owner=self.owner_name,
            option=self.option,
            placeholder=placeholder,
        )

    def _render_singleton(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        return self.owner_name

    def _render_callable(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        func = cast(KeyFunction, self.spec)
        try:
            key = func(tuple(args), dict(kwargs))
        except Exception as exc:
            raise self._error(f"the key function raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(key, str) or not key:
            got = repr(key) if key in ("", None) else f"a {type(key).__qualname__}"
            raise self._error(f"the key function must return a non-empty str, got {got}")
        return str.__str__(key)

    def _render_template(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        assert self._signature is not None
        arguments = self._bind_plain(args, kwargs)
        try:
            if arguments is None:
                arguments = self._signature.bind(*args, **kwargs).arguments
        except TypeError as exc:
            raise self._error(
                f"the call does not match {self._func_shown}: {exc} (got {len(args)} "
                f"positional argument(s){self._max_positional} and keywords {sorted(kwargs)})"
            ) from exc
        pieces: list[str] = []
        for part in self._parts:
            if isinstance(part, str):
                pieces.append(part)
            else:
                pieces.append(self._render_field(part, arguments))
        return "".join(pieces)

    def _bind_plain(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """``Signature.bind(...).arguments`` for a signature of plain parameters, without
        inspect; None when the signature is not one or the call does not fit it (then
        ``bind`` binds it, or raises its error)."""
        plain = self._plain
        if plain is None:
            return None
        names, known, required = plain
        if len(args) > len(names):
            return None
        arguments = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in arguments or name not in known:
                return None
            arguments[name] = value
        if len(arguments) < len(names) and not required <= arguments.keys():
            return None
        return arguments

    def _render_field(self, field: _Field, arguments: Mapping[str, Any]) -> str:
        root = field.root
        if root in arguments:
            value = arguments[root]
        elif field.is_param:
            value = self._defaults[root]  # bind succeeded: an omitted parameter has one
        else:
            extra = arguments.get(self._varkw, {}) if self._varkw else {}
            if root not in extra:
                raise self._error(
                    f"placeholder {field.placeholder}: {root!r} is not a parameter of "
                    f"{self._func_shown} and the call passed no keyword argument {root!r}",
                    field.placeholder,
                )
            value = extra[root]
        for is_attr, key in field.steps:
            try:
                value = getattr(value, str(key)) if is_attr else value[key]
            except Exception as exc:
                step = f".{key}" if is_attr else f"[{key!r}]"
                raise self._error(
                    f"cannot resolve placeholder {field.placeholder}: looking up {step} on a value "
                    f"of type {type(value).__qualname__} raised {type(exc).__name__}: {exc}",
                    field.placeholder,
                ) from exc
        try:
            return _encode(value)
        except _Unencodable as exc:
            raise self._error(
                f"placeholder {field.placeholder} has a value of type "
                f"{type(value).__qualname__} {exc}; name a str/int attribute instead "
                f"(e.g. {{{root}.id}}) or give {self.option} as a callable (args, kwargs) -> str",
                field.placeholder,
            ) from None
        except (ValueError, RecursionError) as exc:
            raise self._error(
                f"placeholder {field.placeholder}: cannot write its "
                f"{type(value).__qualname__} value as a key: {exc}",
                field.placeholder,
            ) from exc

    def __repr__(self) -> str:
        hashed = ", hashed=True" if self.hashed else ""
        return f"KeyTemplate({_describe(self.spec)}, owner_name={self.owner_name!r}{hashed})"


__all__ = ["KeyTemplate", "LockKeyError"]
