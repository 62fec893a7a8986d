#!/usr/bin/python3
"""scripts/quality.py — ScMoE's quality comparison: validation loss of each variant, seed and data source.

    /usr/bin/python3 scripts/quality.py                        # the default setting (3 seeds, ~2 min on 2 cores)
    /usr/bin/python3 scripts/quality.py --setting quick        # one seed, a few steps (< 1 min)
    /usr/bin/python3 scripts/quality.py --setting long         # more steps and seeds (hours; not run by reproduce.sh)
    /usr/bin/python3 scripts/quality.py --data notes.txt       # a text file of one's own instead of the sources
    /usr/bin/python3 scripts/quality.py --source fortunes --steps 600 --seeds 1 --eval-every 100   # a custom run
    /usr/bin/python3 scripts/quality.py --list                 # the commands, without running them

The experiment is data, experiments/scmoe/quality.json: the variants (a model file, an --impl,
a model override), the data sources (a folder of text files, or markov:K), the training
hyperparameters (the same for every variant) and the settings (seeds, steps, evaluation
cadence). Every variant x seed x source is one `moelab run --backend cpu` with one rank and one
BLAS thread (which makes a run's losses the same bits every time), --jobs of them at a time
(default: the cores), with `--data`, `--eval-every` and `--eval-batches`: the validation loss
over the held-out windows before the first step and every N steps (moelab's
harness/nn/text_data.hpp).

Where things go (OUT: --out, default results/measured/cpu/quality for the default setting,
results/measured/cpu/quality-<setting> for the others, results/measured/cpu/quality-custom when
--steps, --seeds or --eval-every change a setting): OUT/<source>/<variant>-seed<S>.json, one
moelab result per run, and OUT/summary.json: per source and variant, the final validation loss
(mean, sample standard deviation, min, max and spread over the seeds), the curve (mean, min and
max over the seeds at every evaluation), parameters (total, active per token) and training
FLOPs per token, for markov:K the entropy floor ln K and each variant's gap to it; and each
variant against the reference (top-2): the difference of the means, per seed, and whether the
two variants' seed ranges are apart (every seed of one ends below every seed of the other).
A table is printed, and the figure is drawn (plots/scmoe_quality.py) when matplotlib is there.

The runs are staged in a temporary folder under OUT and moved into OUT only when every one has
succeeded: a failed run stops the experiment with its command and the end of its output, exit
code 1, and OUT is left as it was (no partial summary). Bad input (an unknown setting or
source, a missing file, a moelab that is not there): exit code 2, one line.
Standard library only; run it under `nice` on a shared machine.
"""
import argparse
import concurrent.futures
import datetime
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moelab_results as mr  # noqa: E402

ROOT = mr.ROOT
EXPERIMENT = os.path.join(ROOT, "experiments", "scmoe", "quality.json")
SCHEMA = "moelab.quality/1"
SUMMARY_SCHEMA = "moelab.quality-summary/1"


class InputError(Exception):
    """Bad input: a one-line message, exit code 2."""


# ---- the experiment file ------------------------------------------------------------------------

def load_experiment(path):
    try:
        with open(path) as f:
            e = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: cannot read the experiment: {err}")
    if not isinstance(e, dict) or e.get("schema") != SCHEMA:
        raise InputError(f"{path}: schema = {json.dumps(e.get('schema') if isinstance(e, dict) else None)}, expected {SCHEMA}")
    for key in ("name", "out", "reference", "variants", "sources", "training", "settings", "default_setting"):
        if key not in e:
            raise InputError(f"{path}: missing field {key!r}")
    names = [v.get("name") for v in e["variants"]]
    if len(set(names)) != len(names) or e["reference"] not in names:
        raise InputError(f"{path}: variants {names}: names must be unique and include the reference {e['reference']!r}")
    for v in e["variants"]:
        for key in ("name", "label", "model", "impl"):
            if not isinstance(v.get(key), str):
                raise InputError(f"{path}: variant {v.get('name')!r}: field {key!r} must be a string")
    for s in e["sources"]:
        if not isinstance(s.get("name"), str) or ("data" in s) == ("text_dir" in s):
            raise InputError(f"{path}: source {s.get('name')!r}: needs a name and exactly one of 'data', 'text_dir'")
    for name, st in e["settings"].items():
        seeds, steps, every = st.get("seeds"), st.get("steps"), st.get("eval_every")
        if not (isinstance(seeds, list) and seeds and all(isinstance(x, int) and x >= 0 for x in seeds)
                and len(set(seeds)) == len(seeds)):
            raise InputError(f"{path}: settings.{name}.seeds = {json.dumps(seeds)}: expected distinct integers >= 0")
        if not (isinstance(steps, int) and steps > 0 and isinstance(every, int) and 0 < every <= steps):
            raise InputError(f"{path}: settings.{name}: steps = {steps}, eval_every = {every}: expected 0 < eval_every <= steps")
    if e["default_setting"] not in e["settings"]:
        raise InputError(f"{path}: default_setting {e['default_setting']!r} is not among the settings")
    return e


def text_files(folder):
    """The text files of a folder as one corpus: regular files without an extension (the fortunes
    package's English text; its .dat indexes and .u8 copies left out), in name order."""
    try:
        names = sorted(n for n in os.listdir(folder) if "." not in n and os.path.isfile(os.path.join(folder, n)))
    except OSError as err:
        raise InputError(f"text_dir {folder}: cannot list it ({err.strerror}); on Debian install the package "
                         "fortunes (scripts/setup.sh)")
    if not names:
        raise InputError(f"text_dir {folder}: no text files (files without an extension); on Debian install the "
                         "package fortunes (scripts/setup.sh)")
    return [os.path.join(folder, n) for n in names]


def resolve_sources(e, only=None, files=None):
    """[{name, spec (moelab's --data), data (what it is, short), about}] for the experiment's
    sources (or only some of them), or for --data files."""
    if files:
        out = []
        for f in files:
            if "," in f or not os.path.isfile(f):
                raise InputError(f"--data {f}: not a readable file (one file per --data; no commas)")
            name = mr.slug(os.path.splitext(os.path.basename(f))[0]) or "data"
            if name in [o["name"] for o in out]:
                raise InputError(f"--data {f}: two files named {name}")
            out.append({"name": name, "spec": os.path.abspath(f), "data": os.path.abspath(f),
                        "about": "a text file read as bytes; the last tenth held out"})
        return out
    known = [s["name"] for s in e["sources"]]
    for n in only or []:
        if n not in known:
            raise InputError(f"--source {n}: not a source of the experiment ({', '.join(known)})")
    out = []
    for s in e["sources"]:
        if only and s["name"] not in only:
            continue
        if "data" in s:
            out.append({"name": s["name"], "spec": s["data"], "data": s["data"], "about": s.get("about", "")})
        else:
            paths = text_files(s["text_dir"])
            out.append({"name": s["name"], "spec": ",".join(paths), "about": s.get("about", ""),
                        "data": f"{s['text_dir']}: {len(paths)} files ({', '.join(os.path.basename(p) for p in paths)})"})
    return out


def command(moelab, e, variant, spec, setting, seed, out):
    t = e["training"]
    argv = [moelab, "run", "--model", os.path.join(ROOT, variant["model"]), "--impl", variant["impl"],
            "--backend", "cpu", "--data", spec, "--eval-every", str(setting["eval_every"]),
            "--eval-batches", str(setting.get("eval_batches", 4)), "--steps", str(setting["steps"]),
            "--warmup", str(t.get("warmup", 0)), "--lr", repr(t["lr"]), "--optimizer", t.get("optimizer", "adam"),
            "--seed", str(seed), "--micro-batch", str(t["micro_batch"]), "--out", out]
    if variant.get("model_override"):
        argv[6:6] = ["--model-override", json.dumps(variant["model_override"], separators=(",", ":"))]
    return argv


def shown(argv):
    """A command as one line; a long --data list shortened."""
    return " ".join(shlex.quote(a if len(a) < 200 else a[:60] + f"...({a.count(',') + 1} files)") for a in argv)


# ---- the summary (pure; tested by scripts/tests/test_quality.py) --------------------------------

def stats(values):
    """mean, sample standard deviation (None for one value), min, max and spread (max - min)."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("no values")
    return {"n": len(v), "mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else None,
            "min": min(v), "max": max(v), "spread": max(v) - min(v)}


def band(curves):
    """Curves [[[step, loss], ...] per seed] evaluated at the same steps -> steps, mean, min, max."""
    steps = [p[0] for p in curves[0]]
    for c in curves[1:]:
        if [p[0] for p in c] != steps:
            raise ValueError(f"validation curves at different steps: {steps} and {[p[0] for p in c]}")
    cols = [[c[i][1] for c in curves] for i in range(len(steps))]
    return {"steps": steps, "mean": [statistics.fmean(x) for x in cols], "min": [min(x) for x in cols],
            "max": [max(x) for x in cols]}


def versus(ref, other):
    """A variant's final losses against the reference's, both {seed: loss} over the same seeds:
    the difference of the means (other - reference), per seed, and whether the two seed ranges
    are apart (every seed of one ends below every seed of the other)."""
    if set(ref) != set(other):
        raise ValueError(f"different seeds: {sorted(ref)} and {sorted(other)}")
    a, b = stats(ref.values()), stats(other.values())
    out = {"delta_mean": b["mean"] - a["mean"], "delta_per_seed": {str(s): other[s] - ref[s] for s in sorted(ref)}}
    if a["n"] < 2:
        return {**out, "ranges_apart": None, "verdict": "one seed: no spread to compare with"}
    apart = b["max"] < a["min"] or a["max"] < b["min"]
    return {**out, "ranges_apart": apart,
            "verdict": ("lower than" if b["mean"] < a["mean"] else "higher than") + " the reference beyond the seed spread"
            if apart else "within the seed spread of the reference"}


def summarize_source(results, reference):
    """results: {variant: {seed: moelab result dict}} of one source -> its summary entry."""
    first = next(iter(next(iter(results.values())).values()))
    val = first["metrics"]["validation"]
    floor = val.get("entropy_rate")
    out = {"synthetic": val["synthetic"], "entropy_floor": floor,
           "train_bytes": val.get("train_bytes"), "valid_bytes": val.get("valid_bytes"),
           "tokens_per_evaluation": val["tokens_per_evaluation"], "variants": {}}
    finals = {}
    for name, by_seed in results.items():
        seeds = sorted(by_seed)
        final = {s: by_seed[s]["metrics"]["validation"]["points"][-1][1] for s in seeds}
        finals[name] = final
        r0 = by_seed[seeds[0]]
        p = r0["metrics"]["parameters"]
        st = stats(final.values())
        entry = {"seeds": seeds, "final_loss": {**st, "per_seed": {str(s): final[s] for s in seeds}},
                 "curve": band([by_seed[s]["metrics"]["validation"]["points"] for s in seeds]),
                 "parameters_total": p["total"], "parameters_active_per_token": p["active_per_token"],
                 "top_k": p["top_k"], "training_flops_per_token": r0["metrics"]["model_flops_per_token"]}
        if floor is not None:
            entry["gap_to_floor"] = st["mean"] - floor
        out["variants"][name] = entry
    if reference in finals:
        out["versus_reference"] = {n: versus(finals[reference], f) for n, f in finals.items() if n != reference}
    return out


APART = {True: "yes", False: "no", None: "— (one seed)"}


def table(summary, labels=None):
    """The summary as a markdown table, one row per source and variant."""
    labels = labels or {}
    ref = summary["reference"]
    rows = ["| source | variant | active params/token | training MFLOPs/token | final val. loss, mean ± std "
            "| min – max | vs " + ref + " | beyond the seed spread? |",
            "|---|---|---|---|---|---|---|---|"]
    for src, s in summary["sources"].items():
        name = src + (f" (floor ln K = {s['entropy_floor']:.3f})" if s.get("entropy_floor") is not None else "")
        for v, e in s["variants"].items():
            f = e["final_loss"]
            std = f"{f['std']:.3f}" if f["std"] is not None else "—"
            vs = s.get("versus_reference", {}).get(v)
            rows.append(f"| {name} | {labels.get(v, v)} | {e['parameters_active_per_token']:,.0f} | "
                        f"{e['training_flops_per_token'] / 1e6:.3f} | {f['mean']:.3f} ± {std} | "
                        f"{f['min']:.3f} – {f['max']:.3f} | "
                        + (f"{vs['delta_mean']:+.3f} | {APART[vs['ranges_apart']]} |" if vs else "— | — |"))
    return "\n".join(rows)


# ---- running ------------------------------------------------------------------------------------

def find_moelab(given):
    for m in ([given] if given else [os.environ.get("MOELAB"), os.path.join(ROOT, "build", "harness", "moelab")]):
        if m and os.path.isfile(m) and os.access(m, os.X_OK):
            return os.path.abspath(m)
    raise InputError(f"no moelab binary at {given or 'build/harness/moelab (or $MOELAB)'}: build it "
                     "(cmake --build build --target moelab) or pass --moelab PATH")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--setting", help="a setting of the experiment (quick, full, long; default its default_setting)")
    ap.add_argument("--source", action="append", help="only this source of the experiment (repeatable)")
    ap.add_argument("--data", action="append", metavar="FILE", help="a text file as the source instead (repeatable)")
    ap.add_argument("--out", help="the results folder (default results/measured/cpu/quality[-SETTING])")
    ap.add_argument("--moelab", help="the moelab binary (default $MOELAB, else build/harness/moelab)")
    ap.add_argument("--experiment", default=EXPERIMENT, help=argparse.SUPPRESS)
    ap.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    ap.add_argument("--steps", type=int, help="override the setting's steps (a custom run: its own default folder)")
    ap.add_argument("--seeds", help="override the setting's seeds, e.g. 1,2 (a custom run)")
    ap.add_argument("--eval-every", type=int, help="override the setting's evaluation cadence (a custom run)")
    ap.add_argument("--list", action="store_true", help="print the commands and stop")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="runs at a time, each with one BLAS thread (default: the number of cores)")
    a = ap.parse_args(argv)
    try:
        if a.jobs < 1:
            raise InputError(f"--jobs {a.jobs}: expected a positive number of runs at a time")
        e = load_experiment(a.experiment)
        setting_name = a.setting or e["default_setting"]
        if setting_name not in e["settings"]:
            raise InputError(f"--setting {setting_name}: expected one of {', '.join(e['settings'])}")
        setting = dict(e["settings"][setting_name])
        custom = []
        if a.steps is not None:
            if a.steps < 1:
                raise InputError(f"--steps {a.steps}: expected a positive number of steps")
            setting["steps"] = a.steps
            custom.append(f"steps {a.steps}")
        if a.seeds is not None:
            try:
                seeds = [int(x) for x in a.seeds.split(",")]
            except ValueError:
                seeds = []
            if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
                raise InputError(f"--seeds {a.seeds}: expected distinct integers >= 0 joined by ','")
            setting["seeds"] = seeds
            custom.append(f"seeds {a.seeds}")
        if a.eval_every is not None:
            if not 0 < a.eval_every <= setting["steps"]:
                raise InputError(f"--eval-every {a.eval_every}: expected 1 to the steps ({setting['steps']})")
            setting["eval_every"] = a.eval_every
            custom.append(f"eval every {a.eval_every}")
        setting["eval_every"] = min(setting["eval_every"], setting["steps"])
        if custom:
            setting_name += " (" + ", ".join(custom) + ")"
        sources = resolve_sources(e, a.source, a.data)
        moelab = "moelab" if a.list else find_moelab(a.moelab)
    except InputError as err:
        print(f"quality.py: {err}", file=sys.stderr)
        return 2
    default_out = e["out"] + ("-custom" if custom else "" if setting_name == e["default_setting"] else f"-{setting_name}")
    out = os.path.abspath(a.out or os.path.join(mr.RESULTS, default_out))
    jobs = [(s["name"], s["spec"], v, seed) for s in sources for v in e["variants"] for seed in setting["seeds"]]
    if a.list:
        for src, spec, v, seed in jobs:
            print(shown(command(moelab, e, v, spec, setting, seed, os.path.join(out, src, f"{v['name']}-seed{seed}.json"))))
        return 0

    os.makedirs(out, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".staging-", dir=out)
    t_start = time.monotonic()
    results, host_s = {}, {}
    # One BLAS thread per run, --jobs runs at a time. Measured on the 2-core build machine: two
    # repetitions of one run with OpenBLAS's two threads ended up to 0.13 apart in validation
    # loss, with one thread they gave the same bits; and on these small GEMMs two single-threaded
    # runs side by side finish sooner than one run with two threads.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

    def execute(src, spec, v, seed):
        rel = os.path.join(src, f"{v['name']}-seed{seed}.json")
        dest = os.path.join(stage, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        argv_run = command(moelab, e, v, spec, setting, seed, dest)
        t0 = time.monotonic()
        p = subprocess.run(argv_run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        return rel, dest, argv_run, p, time.monotonic() - t0

    try:
        done = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
            futures = {pool.submit(execute, *job): k for k, job in enumerate(jobs)}
            for fut in concurrent.futures.as_completed(futures):
                rel, dest, argv_run, p, dt = fut.result()
                if p.returncode != 0 or not os.path.exists(dest):
                    pool.shutdown(wait=True, cancel_futures=True)
                    tail = "\n".join(p.stdout.strip().splitlines()[-12:])
                    print(f"quality.py: run {rel} failed (exit code {p.returncode}) after {dt:.1f} s:\n  {shown(argv_run)}\n"
                          f"{tail}\nquality.py: stopped; {out} is left as it was (no summary written)", file=sys.stderr)
                    return 1
                with open(dest) as f:
                    res = json.load(f)
                done[futures[fut]] = res
                host_s[rel] = round(dt, 2)
                pts = res["metrics"]["validation"]["points"]
                print(f"[{len(done)}/{len(jobs)}] {rel}: validation loss {pts[0][1]:.3f} -> {pts[-1][1]:.3f} "
                      f"({dt:.1f} s; {time.monotonic() - t_start:.0f} s so far)", flush=True)
        for k, (src, spec, v, seed) in enumerate(jobs):  # in the experiment's order, whatever finished first
            results.setdefault(src, {}).setdefault(v["name"], {})[seed] = done[k]
        host_s = {rel: host_s[rel] for rel in sorted(host_s)}

        firsts = [r for src in results.values() for v in src.values() for r in v.values()]
        commits = sorted({r.get("commit") or "unknown" for r in firsts})
        summary = {
            "schema": SUMMARY_SCHEMA, "experiment": os.path.relpath(a.experiment, ROOT), "name": e["name"],
            "setting": setting_name, "mode": "measured", "backend": "cpu", "world_size": 1,
            "device": firsts[0]["device"], "commit": commits[0] if len(commits) == 1 else commits,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "reference": e["reference"], "labels": {v["name"]: v["label"] for v in e["variants"]},
            "training": {**{k: v for k, v in e["training"].items() if k != "lr_choice"},
                         "seq_len": firsts[0]["model"]["seq_len"], "steps": setting["steps"],
                         "tokens_per_run": setting["steps"] * e["training"]["micro_batch"] * firsts[0]["model"]["seq_len"],
                         "eval_every": setting["eval_every"], "eval_batches": setting.get("eval_batches", 4),
                         "seeds": setting["seeds"]},
            "variants": {v["name"]: {k: v[k] for k in ("label", "model", "impl", "model_override") if k in v}
                         for v in e["variants"]},
            "host_seconds": {"total": round(time.monotonic() - t_start, 1), "runs": host_s,
                             "runs_at_a_time": a.jobs, "blas_threads_per_run": 1},
            "sources": {s["name"]: {"data": s["data"], "about": s["about"],
                                    **summarize_source(results[s["name"]], e["reference"])} for s in sources},
        }
        mr.write_json(os.path.join(stage, "summary.json"), summary)
        # Every run succeeded: the staged files replace OUT's.
        for folder, _, files in os.walk(stage):
            for f in files:
                rel = os.path.relpath(os.path.join(folder, f), stage)
                os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
                os.replace(os.path.join(folder, f), os.path.join(out, rel))
    finally:
        shutil.rmtree(stage, ignore_errors=True)

    print(f"\nValidation loss after {setting['steps']} steps ({summary['training']['tokens_per_run']:,} tokens), "
          f"setting {setting_name}, seeds {setting['seeds']}; measured on cpu ({summary['device']}), commit "
          f"{summary['commit']}; {summary['host_seconds']['total']:.0f} s\n")
    print(table(summary, summary["labels"]))
    where = os.path.relpath(out, ROOT) if out.startswith(ROOT + os.sep) else out
    print(f"\nquality.py: wrote {where}/summary.json and {len(jobs)} results")
    if not a.no_plot:
        fig = os.path.join(out, "scmoe_quality.png")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "plots", "scmoe_quality.py"), "--summary",
                            os.path.join(out, "summary.json"), "--out", fig], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        print(p.stdout.strip() if p.returncode == 0 else f"quality.py: no figure: {p.stdout.strip().splitlines()[-1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
