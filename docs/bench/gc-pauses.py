"""`moeserve serve ARGS` with Python's garbage collector timed (gc.callbacks): every 5 s, on stderr, the time spent
collecting so far, the collections of each generation, the longest full (generation 2) collection and the objects
the collector tracks. Run it against two trees (PYTHONPATH) under the same load to compare their pauses
(docs/bench/log.md, "The loaded heap out of the collector's way").

    PYTHONPATH=. python docs/bench/gc-pauses.py serve CKPT --port 8124 &
    moeserve bench serve --url http://127.0.0.1:8124 --concurrency 32 --duration 30 --input-len 32 --output-len 64
"""

import gc
import sys
import threading
import time

spent = {"s": 0.0, "collections": [0, 0, 0], "longest_full_s": 0.0}
_started = [0.0]


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _started[0]
    spent["s"] += took
    spent["collections"][info["generation"]] += 1
    if info["generation"] == 2:
        spent["longest_full_s"] = max(spent["longest_full_s"], took)


def _report() -> None:
    while True:
        time.sleep(5)
        print(f"gc: {spent['s'] * 1000:.0f} ms collecting, collections by generation {spent['collections']}, longest "
              f"full {spent['longest_full_s'] * 1000:.0f} ms, {len(gc.get_objects())} objects tracked, "
              f"{gc.get_freeze_count()} frozen", file=sys.stderr, flush=True)


if __name__ == "__main__":
    gc.callbacks.append(_timed)
    threading.Thread(target=_report, daemon=True).start()
    from moeserve.cli import main

    sys.exit(main(sys.argv[1:]))
