"""One prepared plan serves calls from many threads at once (the README says so): each
thread moves its own blocks through its own chunks, every byte lands where a serial run
would put it, and the worker pool is shared without deadlock. In a subprocess, so an
abort fails the test instead of killing the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CODE = """
import random, threading, torch, kvlayout
from kvlayout.transfer import prepare

NB, BS, THREADS, ROUNDS = 64, 4, 8, 40
kv = [torch.randn(2, NB, BS, 2, 16) for _ in range(3)]
fmt, reg = kvlayout.normalize_kv_and_discover_format(kv, "vllm", {"kv_layout": "NHD"})
plan = prepare(reg, fmt)
ref = [t.clone() for t in kv]  # what the cache must hold; each thread writes only its blocks
errors = []


def rows(cache, block):  # one block of one K/V half of one layer as chunk rows
    return cache[block].reshape(BS, 32)


def worker(k):
    rng = random.Random(k)
    mine = list(range(k * NB // THREADS, (k + 1) * NB // THREADS))
    try:
        for r in range(ROUNDS):
            ids = rng.sample(mine, rng.randint(1, len(mine)))
            per = rng.choice([1, 2, 8])
            chunks = plan.chunks_for(len(ids), per * BS)
            plan.store_blocks(ids, chunks, num_threads=rng.choice([1, 2, 4]))
            for i, b in enumerate(ids):
                c, j = divmod(i, per)
                for kvi in range(2):
                    for layer in range(3):
                        got = chunks[c][kvi, layer, j * BS:(j + 1) * BS]
                        assert torch.equal(got, rows(ref[layer][kvi], b)), (k, r, b)
            for c in chunks:
                c.copy_(torch.randn(c.shape))
            plan.load_blocks(ids, chunks, num_threads=rng.choice([1, 2, 4]))
            for i, b in enumerate(ids):
                c, j = divmod(i, per)
                for kvi in range(2):
                    for layer in range(3):
                        ref[layer][kvi, b] = chunks[c][kvi, layer, j * BS:(j + 1) * BS].reshape(BS, 2, 16)
    except BaseException as e:
        errors.append(f"thread {k}: {type(e).__name__}: {e}")


threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=240)
assert not any(t.is_alive() for t in threads), "a thread hangs"
assert not errors, errors
assert all(torch.equal(a, b) for a, b in zip(kv, ref)), "the cache differs from a serial run"
print("ok")
"""


def test_one_plan_serves_many_threads_at_once() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CODE)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


FORKS = """
import os, threading, torch, kvlayout
from kvlayout.transfer import block_map

kv = [torch.randn(2, 64, 4, 2, 16) for _ in range(2)]
reg = kvlayout.detect(kv, "vllm", {"kv_layout": "NHD"})
# Once before the threads start: the first build imports what NumPy imports lazily, and a
# fork while another thread holds an import lock leaves the child waiting on it (Python's
# own hazard of fork with threads, not the pools').
block_map(reg, reg, [1, 2, 3], [40, 41, 42]).copy(num_threads=2)
stop = threading.Event()


def busy():  # builds, copies and drops maps while the main thread forks: pools and locks in use
    while not stop.is_set():
        block_map(reg, reg, list(range(0, 16)), list(range(32, 48))).copy(num_threads=2)


threads = [threading.Thread(target=busy) for _ in range(2)]
for t in threads:
    t.start()
for _ in range(30):
    pid = os.fork()
    if pid == 0:  # the child: only this thread exists; the pools must serve it
        m = block_map(reg, reg, [1, 2, 3], [40, 41, 42])
        m.copy(num_threads=2)
        os._exit(0 if torch.equal(kv[0][:, 40:43], kv[0][:, 1:4]) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
stop.set()
for t in threads:
    t.join()
print("ok")
"""


def test_a_forked_child_builds_and_copies_maps_while_the_parent_s_threads_hold_the_pools() -> None:
    """After fork() only the forking thread exists: the worker pool and the table pool of
    map groups start over in the child instead of waiting on locks the parent's threads held."""
    done = subprocess.run(
        [sys.executable, "-c", FORKS], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


SORTING = """
import random
from concurrent.futures import ThreadPoolExecutor
import numpy as np, torch, kvlayout
from kvlayout.transfer import block_map

layers, slots = 32, 12000
device = [[torch.randint(0, 256, (slots, 1, 2), dtype=torch.uint8) for _ in range(layers)] for _ in range(2)]
pool = torch.zeros(2, slots, layers, 1, 2, dtype=torch.uint8)  # SGLang's page_first host pool
dev = kvlayout.detect(device, "sglang")
host = kvlayout.detect(pool, "sglang", {"hicache_layout": "page_first"})


def build(k):
    rnd = random.Random(k)
    n = rnd.choice([3, 50, 1000, 12000])  # 12000 tokens: 768,000 runs, past what a thread keeps
    src, dst = rnd.sample(range(slots), n), rnd.sample(range(slots), n)
    m = block_map(dev, host, src, dst, src_block_size=1, dst_block_size=1, num_tokens=n)
    return k, m._build(force_sort=True).copy()


serial = dict(build(k) for k in range(8))
with ThreadPoolExecutor(4) as ex:
    for rounds in range(2):
        for k, runs in ex.map(build, list(range(8)) * 2):
            assert np.array_equal(runs, serial[k]), k
print("ok")
"""


def test_maps_sorted_on_many_threads_at_once_match_a_serial_build() -> None:
    """The sorting path keeps its tables per thread (and drops them past 32 MiB): builds on
    four threads at once, small and large, give what one thread gives."""
    done = subprocess.run(
        [sys.executable, "-c", SORTING], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


ONE_MAP = """
import threading, torch, kvlayout
from kvlayout.transfer import block_map

src_kv = [torch.randn(2, 16, 16, 4, 64) for _ in range(4)]
src = kvlayout.detect(src_kv, "vllm", {"kv_layout": "NHD"})
errors = []
for round in range(20):
    dst_kv = [torch.zeros(2, 16, 4, 16, 64).transpose(2, 3) for _ in range(4)]  # HND: a permuted map
    ids = list(range(round % 4, 16, 2))
    m = block_map(src, kvlayout.detect(dst_kv, "vllm", {"kv_layout": "HND"}), ids, ids[::-1])
    start = threading.Barrier(4)

    def copies(k):
        try:
            start.wait()  # the first copy() of each thread at once: each may make the native copy
            for _ in range(5):
                m.copy(num_threads=1 + k % 2)  # two threads at a time find the worker pool busy
        except BaseException as e:
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=copies, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    for layer in range(4):
        for a, b in zip(ids, ids[::-1]):
            assert torch.equal(dst_kv[layer][:, b], src_kv[layer][:, a]), (round, layer, a, b)
assert not errors, errors
print("ok")
"""


def test_one_map_serves_copies_from_many_threads_at_once() -> None:
    """A block map is read-only once made (docs/block-maps.md): threads that copy one map
    at once, their first copy() racing to make its native copy and some finding the
    worker pool busy, each leave the bytes the map moves, without a hang or an error."""
    done = subprocess.run(
        [sys.executable, "-c", ONE_MAP], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
