#!/usr/bin/python3
"""plots/compare_sim.py — measured vs simulated, configuration by configuration.

    /usr/bin/python3 plots/compare_sim.py results/validation/cpu
    /usr/bin/python3 plots/compare_sim.py DIR --simulated SIMDIR --out FILE

Reads DIR/measured/c*.json and DIR/simulated/c*.json (written by scripts/validate_sim.sh),
writes DIR/comparison.json and prints a table: step time and the four phases, measured,
simulated and |sim - measured| / measured, then the median and worst step-time error. Where
both runs count their expert GEMM calls per library path (metrics.gemm_paths_taken: cuda, and a
sim whose calibration prices the paths), it says whether the sim priced every call on the path
the GPU ran it on (the same paths in the same shares per op), and lists the ops where it did
not, and apart from them the ops issued a different number of times or by one side only.
--simulated and --out take the simulated results from SIMDIR and write FILE instead
(scripts/resimulate.py: the same measured runs simulated again by another cluster model).
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import moelab_results as mr  # noqa: E402


def main(d, sim_dir=None, out=None):
    sim_dir = sim_dir or os.path.join(d, "simulated")
    out = out or os.path.join(d, "comparison.json")
    rows = []
    files = mr.validation_measured_files(d)
    for m_path in files:
        s_path = os.path.join(sim_dir, os.path.basename(m_path))
        if not os.path.exists(s_path):
            sys.exit(f"compare_sim.py: {s_path} is missing")
        m, s = json.load(open(m_path)), json.load(open(s_path))
        if m.get("mode") != "measured" or s.get("mode") != "simulated":
            sys.exit(f"compare_sim.py: {m_path} must be measured and {s_path} simulated")
        row = {"workload": m["workload"]["name"],
               "measured_step_s": m["metrics"]["step_time_s"]["median"],
               "simulated_step_s": s["metrics"]["step_time_s"]["median"],
               "phases": {}}
        row["step_error"] = abs(row["simulated_step_s"] - row["measured_step_s"]) / row["measured_step_s"]
        paths = mr.gemm_path_agreement(m, s)
        if paths is not None:
            row["gemm_paths"] = paths
        for p in ("gate", "dispatch", "experts", "combine"):
            mv, sv = m["metrics"]["phases_s"].get(p, 0.0), s["metrics"]["phases_s"].get(p, 0.0)
            row["phases"][p] = {"measured_s": mv, "simulated_s": sv,
                                "error": abs(sv - mv) / mv if mv > 0 else None}
        rows.append(row)
    if not rows:
        sys.exit(f"compare_sim.py: no measured results under {d}/measured")
    errors = [r["step_error"] for r in rows]
    first_m = json.load(open(files[0]))
    first_s = json.load(open(os.path.join(sim_dir, os.path.basename(files[0]))))
    summary = {"schema": "moelab.sim-validation/1",
               "mode": "comparison of measured and simulated",
               "device": first_m["device"], "backend": first_m["backend"], "commit": first_m["commit"],
               "date": first_m["date"], "cluster_model": first_s["cluster"]["name"],
               "calibration": first_s["calibration"],
               # The cluster file's GEMM calibration (scripts/validate_sim.sh: the one fitted to
               # this device's profile), null when it prices on its datasheet curves.
               "gemm_calibration": ((first_s["cluster"] or {}).get("efficiency") or {}).get("calibration"),
               "median_step_error": statistics.median(errors), "worst_step_error": max(errors),
               "configurations": rows}
    # The simulated runs' commit and the GEMM path they were priced on when forced
    # (moelab run --gemm-path), so that a re-simulation says what it replays.
    summary["simulated_commit"] = first_s["commit"]
    forced = first_s["metrics"].get("gemm_path_forced")
    if forced:
        summary["gemm_path_forced"] = forced
    tally = mr.gemm_path_tally(rows)
    if tally:
        summary["gemm_paths_agree"] = tally
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, out)
    print(f"{'workload':28} {'measured ms':>12} {'simulated ms':>13} {'error':>7}   experts err  dispatch err")
    for r in rows:
        pe = r["phases"]["experts"]["error"]
        pd = r["phases"]["dispatch"]["error"]
        fmt = lambda e: f"{100 * e:6.1f}%" if e is not None else "    -"
        print(f"{r['workload']:28} {1e3 * r['measured_step_s']:12.3f} {1e3 * r['simulated_step_s']:13.3f} "
              f"{100 * r['step_error']:6.1f}%   {fmt(pe)}      {fmt(pd)}")
    print(f"median step error {100 * summary['median_step_error']:.1f}%, "
          f"worst {100 * summary['worst_step_error']:.1f}% ({summary['device']}, " + (f"profile {summary['calibration']}" if summary['calibration'] != 'datasheet' else 'no profile')
          + (f", GEMM calibration {summary['gemm_calibration']}" if summary["gemm_calibration"] else "") + ")")
    for r in (r for r in rows if "gemm_paths" in r):
        for op, d in r["gemm_paths"]["differ"].items():
            print(f"{r['workload']}: {op} priced on other GEMM paths than measured: "
                  f"measured {d['measured']}, simulated {d['simulated']}")
        if r["gemm_paths"].get("calls_differ"):
            print(f"{r['workload']}: other GEMM calls issued (not a path difference): "
                  + ", ".join(r["gemm_paths"]["calls_differ"]))
    if tally:
        a = tally
        print(f"GEMM paths: the sim priced every expert call on the measured path in {a['agree']} of "
              f"{a['configurations']} configurations")


if __name__ == "__main__":
    args = sys.argv[1:]
    opts = {"--simulated": None, "--out": None}
    pos = []
    while args:
        a = args.pop(0)
        if a in opts and args:
            opts[a] = args.pop(0)
        elif a.startswith("-"):
            sys.exit(__doc__)
        else:
            pos.append(a)
    if len(pos) != 1:
        sys.exit(__doc__)
    main(pos[0], opts["--simulated"], opts["--out"])
