"""A stand-in for a tandem vLLM worker and its engine, for tests of `tandem.vllm.lifeline` without vLLM.

The owner (this process; `--unmarked`: one that does not call `mark_owner`) starts an "engine" with
multiprocessing's spawn from a short-lived thread, as the worker does from a thread-pool thread. The engine
runs the plugin's `register()` as vLLM's EngineCore does, starts a sleeping child of its own, and reports (in
JSON) its pid, its child's pid, whether its lifeline is armed, how many pidfds it holds and the owner variable it
leaves its children.
The owner prints that line only once the starting thread is gone from the kernel and the engine still answers.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from tandem.vllm.lifeline import OWNER_ENV, mark_owner, register


def engine(conn: Connection) -> None:
    register()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
    armed = any(thread.name == "tandem-lifeline" for thread in threading.enumerate())
    pidfds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            pidfds += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    conn.send(json.dumps([os.getpid(), sleeper.pid, armed, pidfds, os.environ.get(OWNER_ENV)]))
    conn.send(conn.recv())  # answers one ping
    time.sleep(600)  # until it is killed


def main() -> None:
    if "--unmarked" not in sys.argv:
        mark_owner()
    here, there = multiprocessing.get_context("spawn").Pipe()
    reports: list[str] = []

    def start_engine() -> None:  # as the worker's thread creating AsyncLLM: returns once the engine is up
        multiprocessing.get_context("spawn").Process(target=engine, args=(there,)).start()
        there.close()  # the engine's end: if the engine dies, `here` reads EOF
        reports.append(here.recv())

    starter = threading.Thread(target=start_engine)
    starter.start()
    starter.join()
    while str(starter.native_id) in os.listdir("/proc/self/task"):
        time.sleep(0.01)
    here.send("ping")  # a PR_SET_PDEATHSIG tied to the starting thread would have killed the engine by now
    assert here.recv() == "ping"
    print(reports[0], flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
