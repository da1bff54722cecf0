"""The SQLite study lock (a file lock beside the database): one holder at a time, across
processes and threads; other studies' locks are separate; the file stays in place."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from autofit.store import Store

HOLD = """
import sys, time
from autofit.store import Store
with Store(sys.argv[1]) as s, s.study_lock(1):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_study_lock_waits_for_another_process(tmp_path):
    db = tmp_path / "a.db"
    with Store(str(db)) as store:
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(db), "1.0"], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            t0 = time.monotonic()
            with store.study_lock(2):  # another study's lock: no wait
                assert time.monotonic() - t0 < 0.5
            with store.study_lock(1):
                waited = time.monotonic() - t0
                assert holder.poll() is not None or waited > 0.5
        finally:
            holder.wait(timeout=30)
        assert waited > 0.5 and holder.returncode == 0
    assert (tmp_path / "a.db.study-1.lock").exists()


def test_a_study_lock_excludes_other_threads(tmp_path):
    with Store(str(tmp_path / "a.db")) as store:
        inside: list[int] = []
        overlaps: list[bool] = []

        def claim(i: int) -> None:
            for _ in range(5):
                with store.study_lock(1):
                    overlaps.append(bool(inside))
                    inside.append(i)
                    time.sleep(0.01)
                    inside.remove(i)

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(overlaps) == 15 and not any(overlaps)
