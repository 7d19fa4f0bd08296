"""What the rate limiter's tests share: the bound's oracle, and a model of ``rate.lua``.

:func:`excess` checks a record of admissions against ``burst + rate * T`` in every window.
:class:`ScheduleModel` decides a call as ``rate.lua`` does, given the server's clock: the
unit tests drive it at adversarial moments (the bound must hold whatever the timing), and
the tests on Redis check that the script answers every call as the model does.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery_redislock._rates import Limit, script_args


def excess(admissions: Sequence[tuple[int, int]], burst: int, limit: Limit) -> list[str]:
    """Every window [a, b] between two admission moments that holds more units than
    ``burst + count * (b - a) / period`` (exactly, in integers); ``admissions``: (moment in
    microseconds, cost) pairs. Windows whose ends are admissions are the fullest there are,
    so none found means none anywhere."""
    ordered = sorted(admissions)
    moments = [moment for moment, _ in ordered]
    found = []
    for i, (start, _) in enumerate(ordered):
        if i and moments[i - 1] == start:
            continue  # a window starts with every admission of its first moment
        units = 0
        for j in range(i, len(ordered)):
            units += ordered[j][1]
            if j + 1 < len(ordered) and moments[j + 1] == moments[j]:
                continue  # and ends with every admission of its last moment
            span = moments[j] - start
            if (units - burst) * limit.period_us > limit.count * span:
                found.append(f"{units} units in {span} us from {start}")
    return found


class ScheduleModel:
    """``rate.lua``'s decision for one limiter, on a clock the caller gives."""

    def __init__(self, limits: Sequence[Limit], burst: int) -> None:
        self.limits = tuple(limits)
        self.burst = burst
        self.tats = [0] * len(self.limits)  # long past: idle

    def call(self, now: int, cost: int, max_wait_us: int) -> tuple[bool, int]:
        """(admitted, wait in microseconds) for a call at ``now``, as the script answers."""
        args = script_args(self.limits, self.burst, cost, max_wait_us)
        increments, tolerances = args[1::2], args[2::2]
        wait = 0
        for tat, increment, tolerance in zip(self.tats, increments, tolerances):
            wait = max(wait, tat + increment - tolerance - now)
        if wait > max_wait_us:
            return False, wait
        slot = now + wait
        self.tats = [max(tat, slot) + inc for tat, inc in zip(self.tats, increments)]
        return True, wait
