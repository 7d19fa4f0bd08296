"""The layout's one hard rule: the core never imports Celery or kombu.

Everything that does lives in ``celery_redislock/celery/`` (the old module paths there
are re-export shims); the demo app is an app, not the core. Imports inside functions
count too: a lazy import is still an import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent.parent / "celery_redislock"
#: Old homes of the Celery layer, kept as re-exports of celery_redislock.celery.*
SHIMS = {"task.py", "parking.py", "cli.py", "signing.py"}


def imported_roots(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
    return found


def core_modules() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "celery" not in path.relative_to(PACKAGE).parts[:-1]
        and "demo" not in path.relative_to(PACKAGE).parts
        and not (path.parent == PACKAGE and path.name in SHIMS)
    ]


def test_the_core_never_imports_celery_or_kombu() -> None:
    modules = core_modules()
    assert len(modules) >= 20  # the scan saw the core
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            imported_roots(path) & {"celery", "kombu", "billiard"}
        )
        for path in modules
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_old_homes_only_re_export() -> None:
    for name in SHIMS:
        tree = ast.parse((PACKAGE / name).read_text(encoding="utf-8"))
        kinds = {type(node).__name__ for node in tree.body}
        assert kinds <= {"Expr", "ImportFrom", "Import", "Assign", "AnnAssign"}, (name, kinds)
        assert not any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in tree.body)


# --------------------------------------------------------------------- one home each

#: The one module that spells Redis names, and the one that decodes script replies.
KEYSPACE = "_keyspace.py"
DECODERS = "_replies.py"

#: Fragments of Redis names: only the keyspace module may spell them (in code; docstrings
#: and comments may name them).
KEY_FRAGMENTS = (
    ":done:",
    ":parked",
    ":kept:",
    ":void:",
    ":wake",
    ":fence",
    ":released",
    ":waiters",
    ":claims",
    "lookahead:",
    "probe:",
    "fence:",
    ":rate:",
)
#: Ends of names: the hand-over queue ``<queue>.redislock``.
KEY_SUFFIXES = (".redislock",)
#: Whole names added to a prefix (``prefix + "parked"``).
PREFIX_NAMES = {"parked", "stats"}

#: Names a script's reply is held in: indexing one of them (``reply[0]``,
#: ``round_.replies[i][0]``) or converting it (``int(code)``) decodes it by hand.
REPLY_NAME = re.compile(r"repl|raw|^codes?$|result|answer")
#: Where indexing such a name is not a script reply: the subscriber's pub/sub pushes
#: (``[kind, channel, data]``, from redis-py's pub/sub connection, not a script).
NOT_SCRIPT_REPLIES = {("_waiting.py", "_apply")}


def package_modules() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "demo" not in path.relative_to(PACKAGE).parts  # an app: its own keys
    ]


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            found.add(id(first.value))
    return found


def spelled_key_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            if id(node) in skip:
                continue
            text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
            if any(f in text for f in KEY_FRAGMENTS) or text.endswith(KEY_SUFFIXES):
                found.append(f"{node.lineno}: {text!r}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and side.value in PREFIX_NAMES:
                    found.append(f"{node.lineno}: + {side.value!r}")
    return found


def _reply_name(node: ast.AST) -> bool:
    while isinstance(node, ast.Subscript):  # round_.replies[i][0]: the base's name
        node = node.value
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return bool(REPLY_NAME.search(name))


def _constant_index(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def hand_decoded_replies(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if (path.name, function.name) in NOT_SCRIPT_REPLIES:
            continue
        for node in ast.walk(function):
            indexed = (
                isinstance(node, ast.Subscript)
                and _constant_index(node.slice)
                and _reply_name(node.value)
            )
            converted = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "int"
                and len(node.args) == 1
                and _reply_name(node.args[0])
            )
            if indexed or converted:
                found.append(f"{node.lineno} ({function.name}): {ast.unparse(node)}")
    return found


def test_no_redis_name_is_spelled_outside_the_keyspace_module() -> None:
    """Every Redis key and channel name is built by ``_keyspace`` (``LockKeys`` and the
    prefix functions), so a newcomer finds them all in one place and a deployment's names
    cannot drift. Heuristic: a string or bytes literal in code (docstrings excepted)
    containing a name fragment (``":done:"``, ``":parked"``, ``":kept:"``, ``":void:"``,
    ``":wake"``, ...) or ending in ``".redislock"``, or ``+ "parked"`` / ``+ "stats"``,
    anywhere but ``_keyspace.py``."""
    modules = package_modules()
    assert len(modules) >= 40  # the scan saw the package, the Celery layer included
    offenders = {
        str(path.relative_to(PACKAGE)): spelled_key_names(path)
        for path in modules
        if path.name != KEYSPACE
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert spelled_key_names(PACKAGE / KEYSPACE)  # the heuristic does see names


def test_no_script_reply_is_decoded_outside_the_decoder_module() -> None:
    """Every Lua script's reply goes through a decoder of ``_replies`` (which refuses a
    malformed one with ``MalformedReplyError``). Heuristic: in any function outside
    ``_replies.py``, a constant index (``reply[0]``, ``codes[0]``, ``raw[1]``,
    ``round_.replies[i][0]``) or an ``int(...)`` of a value whose name looks like a reply
    (``reply``, ``raw``, ``code``/``codes``, ``result``, ``answer``). A command's reply
    held under another name (``acks``, ``pttl``) is not a script's; the subscriber's
    pub/sub pushes (``_waiting._apply``) are not script replies."""
    offenders = {
        str(path.relative_to(PACKAGE)): hand_decoded_replies(path)
        for path in package_modules()
        if path.name != DECODERS
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert hand_decoded_replies(PACKAGE / DECODERS)  # the heuristic does see decoding


# --------------------------------------------------------------------- module size

#: The most lines (as ``wc -l`` counts them) a module of the package may have: past it, a
#: module is doing more than one job.
MODULE_LINES = 600
#: Modules known to be over, each being split by its own work: remove an entry when its
#: module is brought under. Only these; a new module over the bound fails the test.
OVERSIZED: set[str] = set()


def test_no_module_is_over_600_lines() -> None:
    """Every module of the package, the demo app included, is at most ``MODULE_LINES``
    long, but the known exceptions in ``OVERSIZED``."""
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 40  # the scan saw the package
    sizes = {str(path.relative_to(PACKAGE)): path.read_bytes().count(b"\n") for path in modules}
    over = {name: lines for name, lines in sizes.items() if lines > MODULE_LINES}
    offenders = {name: lines for name, lines in over.items() if name not in OVERSIZED}
    assert offenders == {}, (
        f"modules over {MODULE_LINES} lines (split each by job into modules named for "
        f"them, and add them to docs/architecture.md): {offenders}"
    )


# --------------------------------------------------------------------- the Lua library

LUA = PACKAGE / "lua"
#: A script's length at most (its contract header included); the shared functions live in
#: the preludes (``_scripts.PRELUDES``), which may be longer.
SCRIPT_LINES = 90


def _scripts_and_preludes() -> tuple[list[Path], set[str]]:
    from celery_redislock._scripts import PRELUDES

    preludes = {name for names in PRELUDES.values() for name in names}
    scripts = [path for path in sorted(LUA.glob("*.lua")) if path.stem not in preludes]
    return scripts, preludes


def test_every_script_is_a_short_contract_on_the_shared_library() -> None:
    """Each script (not a prelude) opens with its contract, dramatiq-style:
    ``-- name(keys=[...], args=[...]) -> reply``, and is short: what scripts share is in
    the preludes prepended to them."""
    scripts, preludes = _scripts_and_preludes()
    assert len(scripts) >= 15 and {"args", "lock", "grant", "parked"} <= preludes
    for path in scripts:
        text = path.read_text(encoding="utf-8")
        header = "\n".join(line for line in text.splitlines() if line.startswith("--"))
        assert text.startswith(f"-- {path.stem}(keys=["), path.name
        assert "args=[" in header and "->" in header, path.name
        assert len(text.splitlines()) <= SCRIPT_LINES, path.name


def test_the_server_clock_is_read_in_one_place() -> None:
    """``now_us()``/``now_ms()`` (``args.lua``) are the scripts' only reading of TIME."""
    reads = {
        path.name: len(re.findall(r"redis\.p?call\(\s*'time'", path.read_text("utf-8"), re.I))
        for path in sorted(LUA.glob("*.lua"))
    }
    assert {name: n for name, n in reads.items() if n} == {"args.lua": 1}


# --------------------------------------------------------------------- one fork rule

#: The one module that knows about forks: every per-process value lives in it.
PROCESS = "_process.py"


def fork_mechanisms(path: Path) -> list[str]:
    """Calls of ``os.register_at_fork`` and ``os.getpid`` in ``path`` (code only)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"register_at_fork", "getpid"}
        ):
            found.append(f"{node.lineno}: {node.func.attr}")
    return found


def test_per_process_state_follows_one_fork_rule() -> None:
    """No module but _process hooks forks or stamps objects with a raw pid: per-process
    state is a ProcessLocal / ProcessRegistry, or an on_fork reset, and a stamp is
    _process.current()."""
    modules = package_modules()
    offenders = {
        str(path.relative_to(PACKAGE)): found
        for path in modules
        if path.name != PROCESS and (found := fork_mechanisms(path))
    }
    assert offenders == {}
    assert [f.split(": ")[1] for f in fork_mechanisms(PACKAGE / PROCESS)].count(
        "register_at_fork"
    ) == 1
