"""Where our server's host time goes under load: a sampling profiler around `actors.serve`.

Runs the server in this process with a thread that samples every thread's Python stack every
--interval seconds; on exit (SIGINT) it writes, per thread, the share of samples whose innermost
frame is in each function ("self") and the share with each function anywhere on the stack
("total"). Drive it with serve_bench (--only ours --model DIR --port-less):

  python benchmarks/profile_serve.py --out /tmp/prof.txt -- --model DIR --port 8123 --batch 32 &
  ... load ..., then kill -INT the server

serve_bench does both when given --profile-out (ours only).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import runpy
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interval", type=float, default=0.001)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    serve_args = [a for a in args.serve_args if a != "--"]

    self_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    stop = threading.Event()

    def where(code) -> str:
        path = code.co_filename
        for base in (str(ROOT) + os.sep, sys.prefix):
            if path.startswith(base):
                path = path[len(base) :].lstrip(os.sep)
        return f"{path}:{code.co_name}"

    def sampler() -> None:
        me = threading.get_ident()
        while not stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                thread = names.get(ident, str(ident))
                samples[thread] += 1
                self_counts[thread][where(frame.f_code)] += 1
                seen = set()
                while frame is not None:
                    key = where(frame.f_code)
                    if key not in seen:
                        total_counts[thread][key] += 1
                        seen.add(key)
                    frame = frame.f_back
            time.sleep(args.interval)

    def report() -> None:
        stop.set()
        lines = []
        for thread, n in samples.most_common():
            if n < 20:
                continue
            lines.append(f"== thread {thread}: {n} samples")
            lines.append("   self%  total%  function")
            for key, c in self_counts[thread].most_common(args.top):
                lines.append(f"  {100 * c / n:6.1f}  {100 * total_counts[thread][key] / n:6.1f}  {key}")
            lines.append("   -- by total% --")
            for key, c in total_counts[thread].most_common(args.top):
                lines.append(f"  {100 * self_counts[thread][key] / n:6.1f}  {100 * c / n:6.1f}  {key}")
        args.out.write_text("\n".join(lines) + "\n")

    atexit.register(report)
    threading.Thread(target=sampler, name="profiler", daemon=True).start()
    sys.argv = ["actors.serve", *serve_args]
    try:
        runpy.run_module("actors.serve", run_name="__main__")
    finally:
        report()


if __name__ == "__main__":
    main()
