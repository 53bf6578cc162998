"""Two `spanq bench quality` runs over the same items, paired item by item: what a change moved.

    python scripts/quality_pair.py BEFORE.json AFTER.json
    python scripts/quality_pair.py RUN.json --settings question,attention   # two settings of one run

For each setting both runs measured (task, anchor, recompute), the mean of AFTER − BEFORE over the items both
scored, with a bootstrap 95% interval (resampling items): the spans' agreement, KL and gold-answer log-probability
against stock in the order the spans read (`same_*`) and in the order given (`both_*`), and exact match. Stock's
own answers are the same in both runs (the same items, greedy), so a difference is the spans' alone; the script
says so where they are not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quality import bootstrap

MEASURES = (  # (row field, label)
    ("same_agreement", "agreement vs stock, span order"),
    ("same_kl", "KL vs stock, span order"),
    ("same_gold_lp_delta", "gold log-prob Δ vs stock, span order"),
    ("both_agreement", "agreement vs stock, order given"),
    ("both_kl", "KL vs stock, order given"),
    ("spans_correct", "exact match"),
)


def rows_of(path: Path) -> dict[tuple, dict]:
    rows = json.loads(path.read_text())["rows"]
    return {(r["task"], r["anchor"], r["recompute"], r["item"]): r for r in rows}


def settings_of(path: Path, first: str, second: str) -> tuple[dict[tuple, dict], dict[tuple, dict]]:
    """One run's rows of two recompute settings, keyed alike (the setting named `first/second`)."""
    rows = rows_of(path)
    label = f"{first}->{second}"
    pick = {name: {(t, a, label, i): r for (t, a, rc, i), r in rows.items() if rc == name} for name in (first, second)}
    return pick[first], pick[second]


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--settings" and argv[2].count(",") == 1:
        before, after = settings_of(Path(argv[0]), *argv[2].split(","))
    elif len(argv) == 2:
        before, after = (rows_of(Path(a)) for a in argv)
    else:
        print("\n".join(line.strip() for line in __doc__.strip().splitlines()[2:4]), file=sys.stderr)
        return 2
    common = sorted(set(before) & set(after))
    if not common:
        print("the two runs share no (task, anchor, recompute, item)", file=sys.stderr)
        return 1
    stock_differs = sum(before[k]["stock_answer"] != after[k]["stock_answer"] for k in common)
    if stock_differs:
        print(f"note: stock's answer differs between the runs on {stock_differs} of {len(common)} rows")
    for setting in sorted({k[:3] for k in common}):
        keys = [k for k in common if k[:3] == setting]
        print(f"{'/'.join(setting)}: {len(keys)} items, after − before (paired)")
        for field, label in MEASURES:
            pairs = [(before[k].get(field), after[k].get(field)) for k in keys]
            pairs = [(float(b), float(a)) for b, a in pairs if b is not None and a is not None]
            if not pairs:
                continue
            d = bootstrap([a - b for b, a in pairs])
            mean_b = sum(b for b, _ in pairs) / len(pairs)
            mean_a = sum(a for _, a in pairs) / len(pairs)
            print(f"  {label:38s} {mean_b:.3f} -> {mean_a:.3f}   Δ {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
