"""Seconds of test time per test file, from a pytest JUnit XML report, as the README's table.

    .venv/bin/python -m pytest -n 2 --dist load -q tests --junitxml=times.xml
    python -m benchmarks.test_times times.xml [--other all.xml] [--top 0]

Seconds are summed over each file's tests (setup, call and teardown, as pytest-xdist reports them),
so the column adds up to worker time: with two workers the wall time is about half of it.
``--other`` adds a second column (e.g. ``make test-all``'s report next to ``make test``'s).
"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def per_file(path: str) -> dict[str, list]:
    """``{file: [seconds, tests]}``."""
    out: dict = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py"
        out[name][0] += float(case.get("time", 0))
        out[name][1] += 1
    return dict(out)


def table(a: dict, b: dict | None = None, top: int = 0) -> str:
    files = sorted(set(a) | set(b or {}), key=lambda f: -max(a.get(f, [0])[0], (b or {}).get(f, [0])[0]))
    head = "| test file | tests | seconds |" + (" tests (all) | seconds (all) |" if b is not None else "")
    rule = "|---|---:|---:|" + ("---:|---:|" if b is not None else "")
    rows = [head, rule]
    shown = files[:top] if top else files
    for f in shown:
        n, s = a.get(f, [0.0, 0])[1], a.get(f, [0.0, 0])[0]
        row = f"| `{f}` | {n} | {s:,.0f} |"
        if b is not None:
            row += f" {b.get(f, [0.0, 0])[1]} | {b.get(f, [0.0, 0])[0]:,.0f} |"
        rows.append(row)
    if top and len(files) > top:
        rest = files[top:]
        row = f"| {len(rest)} other files | {sum(a.get(f, [0, 0])[1] for f in rest)} | " \
              f"{sum(a.get(f, [0.0, 0])[0] for f in rest):,.0f} |"
        if b is not None:
            row += f" {sum(b.get(f, [0, 0])[1] for f in rest)} | {sum(b.get(f, [0.0, 0])[0] for f in rest):,.0f} |"
        rows.append(row)
    row = f"| **total** | {sum(v[1] for v in a.values())} | {sum(v[0] for v in a.values()):,.0f} |"
    if b is not None:
        row += f" {sum(v[1] for v in b.values())} | {sum(v[0] for v in b.values()):,.0f} |"
    rows.append(row)
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--other", help="a second report, shown as a second column")
    ap.add_argument("--top", type=int, default=0, help="show the slowest N files and one row for the rest")
    a = ap.parse_args(argv)
    print(table(per_file(a.report), per_file(a.other) if a.other else None, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
