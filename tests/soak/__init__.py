"""Soak: long runs of the lock and of LockedTask under faults, with counts and a verdict.

    ./dev soak                     # the full run (10-35 minutes on 2 cores)
    ./dev soak --quick             # the smoke preset the default suite runs (< 30 s)
    ./dev soak --parts b --seed 7  # one part, a replayable seed

Part A (tests/soak/locks.py): fenced acquisitions of one lock by ``--processes``
processes, reaching a private redis-server (AOF, ``appendfsync always``) through a
proxy, while holders are SIGKILLed (and replaced) and SIGSTOPped (briefly or past
their lease), every connection is dropped at the proxy, and the server is SIGKILLed
and restarted. Oracles: 0 stale writes accepted, 0 overlaps of valid leases, no lost
update, every expected section completed, every process acquiring in every phase
(of 30 s or more) between restarts.

Part B (tests/soak/settlements.py): ``--settlements`` LockedTask settlements over
``--accounts`` accounts on real prefork ``celery worker`` processes whose pool
processes are SIGKILLed every few seconds, with the broker's redis-server (AOF;
broker, results and locks) restarted in the middle. Oracles: every balance exact,
every task id applied exactly once (a fenced, idempotent ledger in another
redis-server), no run of a finished task without a crash to explain it, no overlap,
nothing left locked, queued or unacknowledged at the end.

Counts are printed as it goes and in a final table; the exit status is 1 on any
violation (each printed), 0 otherwise. ``--defeat`` runs the same without a lock, to
show that the oracles catch it.
"""
