"""The step times of two trees side by side, from ``benchmarks/ab_step.sh``'s runs: per geometry, dtype and
optimizer, the median over the repeats of each tree's ``step ms`` (and ``host ms``), and this tree's ratio to the
other's.

    python benchmarks/ab_table.py results/ab
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
from collections import defaultdict


def collect(out: str):
    """{(geometry, dtype, optimizer): {tree: ([step ms], [host ms])}} from ``out/<tree>_<k>/step_*.json``."""
    table = defaultdict(lambda: defaultdict(lambda: ([], [])))
    for path in sorted(glob.glob(os.path.join(out, "*_*", "step_*.json"))):
        tree = os.path.basename(os.path.dirname(path)).rsplit("_", 1)[0]
        with open(path) as fh:
            for r in json.load(fh)["results"]:
                steps, hosts = table[(r["geometry"], r["dtype"], r["name"])][tree]
                steps.append(r["step_ms"])
                hosts.append(r["host_ms"])
    return table


def main(out: str) -> None:
    table = collect(out)
    print("| geometry | dtype | optimizer | base step ms | this step ms | this / base | base host ms | this host ms |")
    print("|---|---|---|---|---|---|---|---|")
    for (geo, dtype, name), trees in table.items():
        if "base" not in trees or "this" not in trees:
            continue
        (b, bh), (t, th) = trees["base"], trees["this"]
        mb, mt = statistics.median(b), statistics.median(t)
        print(
            f"| {geo} | {dtype} | {name} | {mb:.3f} | {mt:.3f} | {mt / mb:.3f} | {statistics.median(bh):.3f} | "
            f"{statistics.median(th):.3f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/ab")
