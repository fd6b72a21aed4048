"""The `attnprobe` program (the console script; `python -m attnprobe`): main() in a process set up for
one job that ends as soon as its work is written. Calling main() itself (a notebook, CliRunner, the
tests' forked commands) changes none of this.

A short run's time that is not its work, measured on 300 CrowS-Pairs pairs (benchmarks/startup.py):

- the collector: importing torch and transformers leaves about 370,000 long-lived objects, which the
  default thresholds (a young collection every 700 new containers) scan in full six times on the
  way: 0.4 s. With YOUNG_OBJECTS none run during the imports; collections still run in a long job.
- the heap: glibc gives the free top of its heap back to the system (past 128 KB by default) and
  takes it again at the next forward pass, where the kernel faults in and zeroes the pages afresh
  (1,500 moves of the heap's end and a million page faults in that run: 0.7 s of 8 s of passes). Here
  the heap grows by HEAP_STEP at a time, keeps what it frees and serves every block up to HEAP_BLOCKS
  (setting the others stops glibc raising that threshold itself): 34 moves, 380,000 page faults.
- the teardown: the interpreter's finalising of 3,000 modules after main() returns: 1 s. What an
  exit does still happens (a plug-in's threads are waited for, the exit handlers run, logging's flush
  among them, output is flushed), then the process exits with main()'s code.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
import threading

from . import main

YOUNG_OBJECTS = 50_000  # new containers between young collections (Python's default: 700)
HEAP_STEP = 512 * 2**20  # bytes the heap grows by at a time, and keeps at its top when freed
HEAP_BLOCKS = 32 * 2**20  # blocks up to this size come from the heap (glibc's largest), larger ones by mmap
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)


def command_line() -> None:
    """`attnprobe ARGS`: main() as one job's process (the module's note), ending with main()'s code."""
    gc.set_threshold(YOUNG_OBJECTS)
    _heap_kept()
    try:
        main(prog_name="attnprobe")
    except SystemExit as stop:
        code = stop.code
    else:  # click's standalone mode always ends in SystemExit
        code = 0
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing left to write there
            pass
    os._exit(code or 0)


def _heap_kept() -> None:
    """glibc's heap grows by HEAP_STEP and is never trimmed; nothing elsewhere (macOS, Windows, musl:
    no such knob, or one that does nothing). The C library is the one the process has loaded (no
    search: ctypes.util.find_library runs ldconfig, 13 ms of every command's start, --help's too)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)  # the symbols already loaded into the process, its C library's among them
    if hasattr(libc, "gnu_get_libc_version"):  # glibc
        libc.mallopt(M_TOP_PAD, HEAP_STEP)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * HEAP_STEP)
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS)
