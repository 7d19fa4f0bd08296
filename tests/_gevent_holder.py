"""Run under gevent monkey-patching (a separate process): greenlets holding locks."""

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402

import gevent  # noqa: E402
import redis  # noqa: E402

from celery_redislock import RedisLock  # noqa: E402


def main(port: int) -> int:
    client = redis.Redis(port=port, socket_timeout=5)
    failures: list[str] = []

    def hold(i: int) -> None:
        lock = RedisLock(client, f"green-{i}", ttl=0.3)
        with lock:
            for _ in range(12):  # 1.2 s: four leases, renewed by the (green) watchdog
                gevent.sleep(0.1)
            try:
                lock.ensure_held()
            except Exception as exc:
                failures.append(f"{i}: {exc!r}")

    def contend() -> bool:
        # Greenlets are owners of their own (threading.local is greenlet-local here).
        first = RedisLock(client, "shared", ttl=5)
        first.acquire()
        other = gevent.spawn(lambda: RedisLock(client, "shared", ttl=5).acquire(blocking=False))
        other.join()
        first.release()
        return other.value is False

    greenlets = [gevent.spawn(hold, i) for i in range(20)]
    gevent.joinall(greenlets, timeout=30)
    separate_owners = contend()
    print(f"failures={failures} separate_owners={separate_owners}")
    return 0 if not failures and separate_owners else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
