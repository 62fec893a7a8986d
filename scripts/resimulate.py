#!/usr/bin/env python3
"""scripts/resimulate.py — simulate a validation set's measured runs again, with another model.

    /usr/bin/python3 scripts/resimulate.py DIR --cluster NAME [--gemm-path PATH] --into SUBDIR

DIR is a folder written by scripts/validate_sim.sh (workloads/cN.json, measured/cN.json and
the routing each measured run recorded, measured/cN.routing.json). Each configuration is run
again with its own implementation and options (impl, impl_options; a result from before
impl_options were recorded replays only as fastmoe, what validate_sim.sh ran) on the sim
backend, one rank of cluster NAME (a catalogue name or a cluster file), replaying the measured
run's own routing, with `moelab run --gemm-path PATH` when given; the
results go to DIR/SUBDIR/simulated/cN.json and plots/compare_sim.py writes
DIR/SUBDIR/comparison.json (median and worst step-time error, per phase).

What it is for: judging a cluster model against measurements that it was not fitted to
without a device at hand. With --gemm-path it replays a build whose expert GEMMs always took
one cuBLAS path (the measurements of an older commit, say), so that the model is judged on
the library path those runs really took.

Nothing is left half-written: the runs go to a temporary folder beside SUBDIR, which replaces
SUBDIR only when every run and the comparison succeeded. Bad input or a failed run: one line
on stderr, exit 2 (input) or 1 (a run), SUBDIR as it was.
Environment: MOELAB (the binary; default build/harness/moelab), MOELAB_EXPERIMENTS (the
catalogue; default this checkout's experiments/). Standard library only.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

PROG = "resimulate.py"


def die(msg, code=2):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def configurations(d):
    """[(name, workload path, routing path, impl, impl options)], the paths relative to d, for
    every measured cN.json."""
    out = []
    for m in mr.validation_measured_files(d):
        base = os.path.basename(m)
        name = base[:-len(".json")]
        w = os.path.join("workloads", base)
        r = os.path.join("measured", name + ".routing.json")
        for rel, what in ((w, "its workload"), (r, "its routing trace")):
            if not os.path.isfile(os.path.join(d, rel)):
                die(f"{m}: {what} {os.path.join(d, rel)} is missing (DIR must be written by scripts/validate_sim.sh)")
        try:
            doc = json.load(open(m))
        except (OSError, ValueError) as e:
            die(f"{m}: not a result file: {e}")
        if doc.get("mode") != "measured":
            die(f"{m}: mode = {doc.get('mode')!r}, expected \"measured\"")
        # The run's implementation with its options as given (impl_options); a result from before
        # they were recorded replays only as fastmoe with none, which is what validate_sim.sh ran.
        impl, options = doc.get("impl"), doc.get("impl_options")
        if options is None:
            if impl != "fastmoe":
                die(f"{m}: impl = {impl!r} without impl_options (a result from before they were recorded): "
                    "its options are unknown, so it cannot be replayed as it ran")
            options = {}
        if not isinstance(impl, str) or not isinstance(options, dict):
            die(f"{m}: impl and impl_options must be a name and an object")
        out.append((name, w, r, impl, options))
    if not out:
        die(f"no measured results under {os.path.join(d, 'measured')} (DIR must be written by scripts/validate_sim.sh)")
    return out


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", metavar="DIR", help="a validation folder written by scripts/validate_sim.sh")
    ap.add_argument("--cluster", required=True, help="the cluster model (a catalogue name or a file)")
    ap.add_argument("--gemm-path", choices=("auto", "loop", "strided_batched", "grouped"), default="auto",
                    help="the expert GEMMs' cuBLAS path to price (moelab run --gemm-path; default auto)")
    ap.add_argument("--into", required=True, metavar="SUBDIR", help="the folder under DIR to write (a plain name)")
    a = ap.parse_args()
    d = os.path.abspath(a.dir)
    if not os.path.isdir(d):
        die(f"DIR {a.dir}: not a folder")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", a.into) or a.into in (".", "..", "measured", "simulated", "workloads"):
        die(f"--into {a.into!r}: expected a plain folder name other than measured, simulated and workloads")
    if os.path.lexists(os.path.join(d, a.into)) and not os.path.isdir(os.path.join(d, a.into)):
        die(f"--into {a.into!r}: {os.path.join(d, a.into)} exists and is not a folder")
    moelab = os.environ.get("MOELAB", os.path.join(ROOT, "build", "harness", "moelab"))
    if not os.access(moelab, os.X_OK):
        die(f"{moelab} is not built (scripts/test.sh builds it; or set MOELAB)")
    env = dict(os.environ, MOELAB_EXPERIMENTS=os.environ.get("MOELAB_EXPERIMENTS", os.path.join(ROOT, "experiments")))
    cluster = os.path.abspath(a.cluster) if os.path.isfile(a.cluster) else a.cluster
    runs = configurations(d)

    final = os.path.join(d, a.into)
    tmp = tempfile.mkdtemp(prefix=f".{a.into}.", dir=d)
    try:
        os.makedirs(os.path.join(tmp, "simulated"))
        for i, (name, w, r, impl, options) in enumerate(runs, 1):
            out = os.path.join(os.path.basename(tmp), "simulated", name + ".json")
            cmd = [moelab, "run", "--workload", w, "--impl", impl, "--backend", "sim", "--cluster", cluster,
                   "--ranks", "1", "--routing", "trace:" + r, "--out", out]
            if options:
                cmd += ["--impl-options", json.dumps(options, separators=(",", ":"))]
            if a.gemm_path != "auto":
                cmd += ["--gemm-path", a.gemm_path]
            print(f"== [{i}/{len(runs)}] {name}: " + " ".join(cmd[1:]), flush=True)
            # From DIR: the result records its workload and routing by the names given here.
            p = subprocess.run(cmd, cwd=d, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if p.returncode != 0:
                die(f"{name}: moelab run failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}",
                    2 if p.returncode == 2 else 1)
        cmp = [sys.executable, os.path.join(ROOT, "plots", "compare_sim.py"), d,
               "--simulated", os.path.join(tmp, "simulated"), "--out", os.path.join(tmp, "comparison.json")]
        if subprocess.run(cmp).returncode != 0:
            die("plots/compare_sim.py failed", 1)
        # The old folder moves aside first, so that an interruption leaves one of the two whole.
        old = None
        if os.path.isdir(final):
            old = tempfile.mkdtemp(prefix=f".{a.into}.old.", dir=d)
            os.replace(final, os.path.join(old, "x"))
        os.replace(tmp, final)
        tmp = None
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {final}/comparison.json and {final}/simulated/")


if __name__ == "__main__":
    main()
