"""The layout's one hard rule: the core never imports Celery or kombu.

Everything that does lives in ``celery_redislock/celery/`` (the old module paths there
are re-export shims); the demo app is an app, not the core. Imports inside functions
count too: a lazy import is still an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "celery_redislock"
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
