"""Per-thread summary of a `py-spy record --threads -f raw` profile: the share of each thread's
active samples whose innermost frame is a function ("self") and that have it anywhere ("total").

  py-spy record -p PID -d 8 -r 500 --threads -f raw -o prof.raw --nonblocking
  python benchmarks/pyspy_summary.py prof.raw [TOP]
"""

from __future__ import annotations

import collections
import sys


def summarize(path: str, top: int = 30) -> str:
    self_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        thread, *frames = stack.split(";")
        # "function (path/to/file.py:line)" -> "function file.py"
        names = [f.split(" (")[0] + " " + f.rpartition("(")[2].split(":")[0].rsplit("/", 1)[-1] for f in frames]
        samples[thread] += n
        if names:
            self_counts[thread][names[-1]] += n
        for name in set(names):
            total_counts[thread][name] += n
    out = []
    for thread, n in samples.most_common():
        out.append(f"== {thread}: {n} active samples")
        out += [f"  self  {100 * c / n:5.1f}%  {f}" for f, c in self_counts[thread].most_common(top)]
        out += [f"  total {100 * c / n:5.1f}%  {f}" for f, c in total_counts[thread].most_common(top + 10)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30))
