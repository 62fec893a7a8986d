#!/usr/bin/python3
"""scripts/claims.py — every paper claim of every suite beside our figure, as one table.

    /usr/bin/python3 scripts/claims.py                      # the summaries under results/
    /usr/bin/python3 scripts/claims.py --results /tmp/r --suite mpipemoe

Reads each suite's summary (RESULTS/<suite out>/summary.json); where a newer one waits under
RESULTS/candidate/ (a run whose simulated results differ from the committed ones and were not
accepted), that one is shown and marked "candidate". Columns: the claim and its source, the
paper's figure, ours (max or mean as the claim says, on the paper's setup when the run has
it; a claim on runs: over the runs it selects, which are listed), measured or simulated, and whether
direction and size agree. A suite without a summary
is named; exit code 2 only when a summary is malformed. Standard library only.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moelab_results as mr  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--results", default=mr.RESULTS)
    ap.add_argument("--suite", action="append", help="a suite (repeatable; default every registered suite)")
    a = ap.parse_args()
    try:
        suites = [mr.load_suite(s) for s in (a.suite or mr.registered_suites())]
        rows, notes = [], []
        for s in suites:
            cand = mr.summary_path(s, os.path.join(a.results, "candidate"))
            path = cand if os.path.exists(cand) else mr.summary_path(s, a.results)
            if not os.path.exists(path):
                notes.append(f"{s['name']}: no summary at {path} (run scripts/run_suite.py --suite {s['name']})")
                continue
            summ = mr.load_summary(path)
            got = mr.claim_rows(summ)
            tag = " (candidate)" if path == cand else ""
            for r in got:
                r["suite"] += tag
            rows += got
            if not got:
                notes.append(f"{s['name']}{tag}: no paper claims ({summ['subset']} run, {summ['mode']})")
    except mr.SchemaError as e:
        print(f"claims.py: {e}", file=sys.stderr)
        return 2
    print("\npaper claims against ours")
    if rows:
        cols = [("suite", 10), ("claim", 64), ("paper", 6), ("ours", 7), ("over", 22), ("mode", 9),
                ("direction", 9), ("size", 4), ("source", 0)]
        for r in rows:
            where = {"paper_setup": "paper setup", "runs": "runs"}.get(r["scope"], "all points")
            r["over"] = f"{where}, {r['points']} pts"
        print("  ".join(f"{c:{w}}" for c, w in cols).rstrip())
        for r in rows:
            print("  ".join(f"{r[c][:w]:{w}}" if w else r[c] for c, w in cols))
        ran = [r for r in rows if r["points"] != "0"]
        paired = [r for r in ran if r["direction"] != "-"]
        single = [r for r in ran if r["direction"] == "-"]  # one system's figure (a share, an overlap): no direction
        agree = sum(1 for r in paired if r["direction"] == "yes" and r["size"] == "yes")
        print(f"{len(rows)} claims: {agree} agree in direction and size, "
              f"{sum(1 for r in paired if r['direction'] == 'yes') - agree} in direction only, "
              f"{sum(1 for r in paired if r['direction'] == 'no')} disagree"
              + (f", {sum(1 for r in single if r['size'] == 'yes')} of {len(single)} figures of one system agree "
                 "in size" if single else "")
              + f", {len(rows) - len(ran)} not run (size: ours within the suite's tolerance of the paper's figure)")
        for r in rows:
            if r["scope"] == "runs" and r["points"] != "0":
                print(f"  {r['suite']} {r['id']}: {r['on']}")
    for n in notes:
        print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
