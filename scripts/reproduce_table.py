"""README's verdict table of `refdml reproduce`, from the JSON of a quick and a default run.

    python scripts/reproduce_table.py docs/reproduce_quick/results.json docs/reproduce_full/results.json

Prints a Markdown table: per comparison, each run's effect with its 95 % interval and
verdict; for an inconclusive one also the bound it sets (|effect| < bound) and the seeds that
would decide a 0.02 effect. The numbers are the runs' own, never retyped.
"""

from __future__ import annotations

import json
import sys


def _cell(c: dict | None) -> tuple[str, str]:
    if c is None:
        return "-", "-"
    if c["n"] < 2 or c["low"] is None:
        return "-", c["verdict"]
    text = f"{c['effect']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"
    verdict = c["verdict"]
    if verdict == "inconclusive":
        resolution = c.get("resolution", 0.02)
        if c["bound"] < resolution:     # the interval already rules the resolution out
            verdict = (f"inconclusive: \\|effect\\| < {c['bound']:.3f}, an effect of "
                       f"{resolution:g} ruled out")
        else:
            need = c.get("seeds_needed")
            seeds = "" if need is None else f", ~{need:.0f} seeds would decide {resolution:g}"
            verdict = f"inconclusive: \\|effect\\| < {c['bound']:.3f}{seeds}"
    return text, verdict


def main(quick_path: str, full_path: str) -> None:
    quick, full = (json.load(open(p, encoding="utf-8")) for p in (quick_path, full_path))
    by_id = {r["id"]: r for r in full["experiments"]}
    q_seeds = {r["id"]: r["seeds"] for r in quick["experiments"]}
    print(f"| experiment | comparison (claimed) | `--quick`: effect [95 % CI] | verdict | "
          f"default run: effect [95 % CI] | verdict |")
    print("|---|---|---|---|---|---|")
    for r in quick["experiments"]:
        other = {c["name"]: c for c in by_id.get(r["id"], {"comparisons": []})["comparisons"]}
        seeds = f" ({q_seeds[r['id']]} / {by_id[r['id']]['seeds'] if r['id'] in by_id else '-'} seeds)"
        for i, c in enumerate(r["comparisons"]):
            q_text, q_verdict = _cell(c)
            f_text, f_verdict = _cell(other.get(c["name"]))
            name = f"`{r['id']}`{seeds}" if i == 0 else ""
            print(f"| {name} | {c['name']} | {q_text} | {q_verdict} | {f_text} | {f_verdict} |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
