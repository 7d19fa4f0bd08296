"""The payments scene: the same payments settled without and with ``LockedTask``.

A plain read-modify-write per payment loses updates when two payments to one account
run at once; under ``LockedTask(lock_key="account:{account}")`` none is lost, and a
payment that finds its account busy is parked behind the holder instead of blocking a
worker slot. The table shows lost updates, exact balances, parkings, and the time taken
against the ideal (the hottest account's payments one after another, or the whole batch
spread over the pool, whichever is longer).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from collections import Counter
from types import ModuleType
from typing import Any

import redis

from ._run import send_and_follow


def outcome(
    store: redis.Redis,
    prefix: str,
    phase: str,
    payments: list[tuple[int, int]],
    amounts: dict[int, int],
    accounts: int,
) -> tuple[int, int]:
    """(lost updates, accounts whose balance is exact)."""
    lost = 0
    exact = 0
    for account in range(accounts):
        applied = set(json.loads(store.get(f"{prefix}{phase}:account:{account}") or "[]"))
        expected = {pid for pid, acct in payments if acct == account}
        lost += len(expected - applied)
        exact += sum(amounts[p] for p in applied) == sum(amounts[p] for p in expected)
    return lost, exact


def _send(task: Any, payments: list[tuple[int, int]]) -> None:
    for payment_id, account in payments:
        task.delay(account, payment_id)


def run(args: argparse.Namespace, store: redis.Redis, demo: ModuleType) -> bool:
    """Run the scene and print its table; True when the locked column is right."""
    rng = random.Random(args.seed)
    payments = [(pid, rng.randrange(args.accounts)) for pid in range(args.payments)]
    amounts = {pid: rng.randrange(100, 10_000) for pid, _ in payments}
    hottest = Counter(acct for _, acct in payments).most_common(1)[0][1]
    ideal = max(hottest * args.work, args.payments * args.work / args.concurrency)
    print(
        f"\npayments: {args.payments} over {args.accounts} accounts, "
        f"{args.work * 1000:.0f} ms read-modify-write each"
    )

    times = {}
    for phase, label, task in (
        ("unlocked", "without a lock", demo.settle_unlocked),
        ("locked", "with LockedTask", demo.settle_locked),
    ):
        times[phase] = send_and_follow(
            label,
            functools.partial(_send, task, payments),
            len(payments),
            store,
            f"{demo.PREFIX}{phase}:done",
            args.timeout,
        )
    lost_u, exact_u = outcome(store, demo.PREFIX, "unlocked", payments, amounts, args.accounts)
    lost_l, exact_l = outcome(store, demo.PREFIX, "locked", payments, amounts, args.accounts)
    parked = demo.parked_count(demo.settle_locked)

    unlocked_time, locked_time = times["unlocked"], times["locked"]
    rows = [
        ("payments settled", f"{args.payments}", f"{args.payments}"),
        ("lost updates", f"{lost_u}", f"{lost_l}"),
        ("exact balances", f"{exact_u} / {args.accounts}", f"{exact_l} / {args.accounts}"),
        ("parked behind the holder", "-", f"{parked}"),
        ("time", f"{unlocked_time:.2f} s", f"{locked_time:.2f} s"),
        ("ideal (hottest account serial)", f"{ideal:.2f} s", f"{ideal:.2f} s"),
        ("time / ideal", f"{unlocked_time / ideal:.2f}x", f"{locked_time / ideal:.2f}x"),
    ]
    print()
    print(f"{'':32}{'without a lock':>18}{'with LockedTask':>18}")
    for label, left, right in rows:
        print(f"{label:32}{left:>18}{right:>18}")
    return lost_l == 0 and exact_l == args.accounts
