"""python3-etcd3 side of bench/etcd_client: the same work as the C++ client, against the same
etcd, run by the C++ benchmark as a child. Prints one JSON object with the figures.

Usage: etcd_client_py.py HOST:PORT PREFIX SEQ_PUTS THREADS PUTS_PER_THREAD WATCH_EVENTS
"""
import json
import os
import sys
import threading
import time

import etcd3


def percentile(sorted_values, p):
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, int(round(p / 100.0 * (len(sorted_values) - 1))))
    return sorted_values[k]


def main():
    endpoint, prefix = sys.argv[1], sys.argv[2]
    seq_puts, threads, per_thread, watch_events = (int(a) for a in sys.argv[3:7])
    host, port = endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=10)
    value = "x" * 64

    cpu_start = time.process_time()
    start = time.monotonic()
    for i in range(seq_puts):
        client.put(f"{prefix}seq/{i}", value)
    sequential = seq_puts / (time.monotonic() - start)

    # One client shared by the threads, as one process would use it.
    def worker(t):
        for i in range(per_thread):
            client.put(f"{prefix}con/{t}/{i}", value)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    start = time.monotonic()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    concurrent = threads * per_thread / (time.monotonic() - start)
    cpu_us_per_put = (time.process_time() - cpu_start) * 1e6 / (seq_puts + threads * per_thread)

    # Watch latency: put one key, wait until its event arrives, repeat.
    got = threading.Event()
    received = {}

    def on_event(response):
        now = time.monotonic()
        for event in getattr(response, "events", []):
            received[event.key.decode()] = now
        got.set()

    watch_id = client.add_watch_prefix_callback(f"{prefix}watch/", on_event)
    latencies = []
    try:
        for i in range(watch_events):
            key = f"{prefix}watch/{i}"
            got.clear()
            sent = time.monotonic()
            client.put(key, value)
            deadline = sent + 10
            while key not in received:
                if not got.wait(max(0.0, deadline - time.monotonic())):
                    raise SystemExit(f"python3-etcd3: no watch event for {key} within 10 s")
                got.clear()
            latencies.append((received[key] - sent) * 1000.0)
    finally:
        client.cancel_watch(watch_id)
    latencies.sort()
    print(json.dumps({
        "sequential_puts_per_s": sequential,
        "concurrent_puts_per_s": concurrent,
        "watch_p50_ms": percentile(latencies, 50),
        "watch_p99_ms": percentile(latencies, 99),
        "watch_latencies_ms": latencies,
        "cpu_us_per_put": cpu_us_per_put,
    }))
    sys.stdout.flush()
    # Not client.close(): python3-etcd3's watch thread may then try to re-open its stream on the
    # closed channel and print a traceback (a shutdown race in that client, not a failure here).
    os._exit(0)


if __name__ == "__main__":
    main()
