#!/usr/bin/python3
"""scripts/run_suite.py — run experiment suites (experiments/<name>/suite.json) into the result store.

    /usr/bin/python3 scripts/run_suite.py                          # every registered suite, in full
    /usr/bin/python3 scripts/run_suite.py --suite mpipemoe --quick # one suite's reduced subset
    /usr/bin/python3 scripts/run_suite.py --extended               # also the sweeps and runs marked "extended"
    /usr/bin/python3 scripts/run_suite.py --backends sim --quick --out /tmp/r   # what CI runs
    /usr/bin/python3 scripts/run_suite.py --list                   # the runs, without running them
    /usr/bin/python3 scripts/run_suite.py --update-baseline        # accept changed simulated results
    /usr/bin/python3 scripts/run_suite.py --suite mpipemoe --run gpu-sim   # one run of a suite, no grid

A suite is data (docs/RESULTS-SCHEMA.md, "Suite files"): a "grid" of generated workloads
(models x clusters x dtypes x tokens per GPU, on the sim backend) and/or "runs" of workload
files or whole models ("models": moelab run --model, in training or inference) on any backend
(sim with cluster models; cpu with MPI ranks under mpirun; cuda when `moelab list` reports a
device; "hostfile" ranks on a real cluster with --hostfile). Every entry a machine cannot run
(cuda without a device, an option or --inference the binary rejects, a model file not in the
checkout, a backend left out by --backends) is listed as skipped, on stdout and in the summary;
nothing is skipped silently. The paper claims are judged on the grid's points or, for a claim
with "on": "runs", on the whole-model runs it selects. A run that fails is reported with the end of its output, recorded in the
summary, and makes the exit code 1; the other runs go on.

Where things go (OUT = --out, default results/): every run is written first under
OUT/candidate/<its path>, with OUT/candidate/<suite out>/summary.json per suite. Then the
candidate is merged into OUT (scripts/compare_results.py, install): measured results are
always written; a simulated result (deterministic) is written when it is new, left alone
when it equals the one in OUT within 1e-9 relative, and when it differs it stays under
OUT/candidate/ and the difference is printed, unless --update-baseline is given. A summary is
never written over one of a larger subset (quick < full < extended). Exit code 1 when something differs or failed.
With --run ID (repeatable) only the suites' runs of that id go (the grid and the other runs do
not), and no summary is written: a summary describes a whole suite run, and a partial one
would replace it; --workload NAME (repeatable) then keeps only those runs' jobs of that
workload (or model file), to split one id's runs over several calls on a lent GPU. The results
are merged as above. One run at a time per OUT: a second
run_suite.py into the same folder stops at once (OUT/.run_suite.lock names the first's pid),
since both would stage under OUT/candidate/.

Simulated runs go --jobs at a time (default: the number of cores; each is one process on one
core, and their results do not depend on it); a measured run (cpu, cuda) runs alone, with
nothing else on the machine. Progress: one line per finished run with the suite, runs done /
total, elapsed time and time left.
Standard library only.
"""
import argparse
import concurrent.futures
import datetime
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moelab_results as mr  # noqa: E402
import compare_results  # noqa: E402

ROOT = mr.ROOT


def lock_out(out):
    """An exclusive lock on OUT/.run_suite.lock for the rest of the process: two runs into one
    results folder would share (and wipe) OUT/candidate/. A second run fails at once, naming the
    first one's pid."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, ".run_suite.lock")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        die(f"another run_suite.py (pid {holder}) is writing into {out}: wait for it to finish, or give this "
            f"run its own --out DIR")
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def die(msg, code=2):
    print(f"run_suite.py: {msg}", file=sys.stderr)
    sys.exit(code)


def fmt_s(s):
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def rel_to(path, base):
    p = os.path.relpath(path, base)
    return path if p.startswith("..") else p


# ---- expanding a suite into runs ------------------------------------------------------------

def grid_points(suite, quick, extended=False):
    """Every (sweep, cluster, model, dtype, tokens per GPU) of the grid, in order, no repeats;
    sweeps marked "extended" only with extended."""
    g = suite.get("grid")
    if not g:
        return []
    clusters = {c["name"]: c for c in g["clusters"]}
    as_gpus = g.get("global_tokens_as_gpus")
    pts, seen = [], set()
    key = "quick_sweeps" if quick else "sweeps"
    for i, sw in enumerate(g.get(key, [])):
        if sw.get("extended") and not extended:
            continue
        for cname in sw["clusters"]:
            gpus = clusters[cname]["gpus"]
            for mname in sw["models"]:
                for dtype in sw["dtypes"]:
                    for b in sw["tokens_per_gpu"]:
                        if as_gpus and (b * as_gpus) % gpus:
                            raise mr.field_error(suite["_path"], f"grid.{key}[{i}].tokens_per_gpu",
                                                 f"{b} * {as_gpus} tokens do not split over {gpus} GPUs of {cname}")
                        tpr = b * as_gpus // gpus if as_gpus else b
                        point = (cname, mname, dtype, tpr)
                        if point in seen:
                            continue
                        seen.add(point)
                        pts.append({"sweep": sw["name"], "cluster": cname, "gpus": gpus, "model": mname,
                                    "dtype": dtype, "tokens_per_gpu": b, "tokens_per_rank": tpr,
                                    "global_tokens": tpr * gpus})
    return pts


def suite_subset(suite, subset):
    """The subset a suite's summary records: "extended" only for a suite that has extended
    sweeps or runs (for the others an extended run is their full run, and its summary must not
    outrank a later full one)."""
    has = any(sw.get("extended") for sw in (suite.get("grid") or {}).get("sweeps", [])) or \
        any(r.get("extended") for r in suite.get("runs", []))
    return "full" if subset == "extended" and not has else subset


def check_quick_subset(suite):
    """The quick subset's points must be points of the full run (same files), so that a quick
    run compares with the committed full results point by point."""
    full = {(p["cluster"], p["model"], p["dtype"], p["tokens_per_rank"]) for p in grid_points(suite, False)}
    for p in grid_points(suite, True):
        if (p["cluster"], p["model"], p["dtype"], p["tokens_per_rank"]) not in full:
            raise mr.SchemaError(f"{suite['_path']}: grid.quick_sweeps: {p['cluster']} {p['model']} {p['dtype']} "
                                 f"B={p['tokens_per_gpu']} is not a point of grid.sweeps (a quick point must be "
                                 f"one of the full run's, so that it has a committed result to compare with)")


def grid_workload(suite, model_name, dtype, tokens_per_rank):
    g = suite["grid"]
    model = next(m for m in g["models"] if m["name"] == model_name)
    d = g["workload_defaults"]
    name = f"{model['name']}-{dtype}-T{tokens_per_rank}"
    # "tf32": fp32 tensors whose GEMMs run on TF32 tensor cores (the model's "allow_tf32").
    mdtype, extra = ("fp32", {"allow_tf32": True}) if dtype == "tf32" else (dtype, {})
    return name, {
        "name": name,
        "description": (f"{suite['name']} suite: {model['name']} (d_model {model['d_model']}, d_hidden "
                        f"{model['d_hidden']}), {d['num_experts']} experts, top-{d['top_k']}, "
                        + ("no capacity limit" if not d["capacity_factor"] else f"capacity factor {d['capacity_factor']}")
                        + f", {dtype}, {tokens_per_rank} tokens per rank. Written by scripts/run_suite.py "
                        f"from experiments/{suite['name']}/suite.json."),
        "model": {"name": model["name"], "d_model": model["d_model"], "d_hidden": model["d_hidden"],
                  "num_experts": d["num_experts"], "top_k": d["top_k"], "capacity_factor": d["capacity_factor"],
                  "activation": d["activation"], "dtype": mdtype, **extra},
        "tokens_per_rank": tokens_per_rank,
        "steps": d["steps"],
        "warmup": d["warmup"],
        "seed": d["seed"],
        "expert_parallel": d["expert_parallel"],
    }


def resolve_workload(suite, spec, field):
    """(name, path of an existing file or None, generated workload or None); field: where the
    suite names it, for the error."""
    if isinstance(spec, dict):
        name, wl = grid_workload(suite, spec["model"], spec["dtype"], spec["tokens_per_rank"])
        return name, None, wl
    path = os.path.join(ROOT, spec) if "/" in spec or spec.endswith(".json") else \
        os.path.join(mr.EXPERIMENTS, "workloads", spec + ".json")
    if not os.path.exists(path):
        raise mr.field_error(suite["_path"], field, f"workload {mr.show(spec)}: no file {rel_to(path, ROOT)}")
    return os.path.splitext(os.path.basename(path))[0], path, None


def expand(suite, quick, extended=False):
    """Every job of the suite (grid points x grid impls, then the runs), in order; the sweeps and
    runs marked "extended" only with extended."""
    impls = {im["label"]: im for im in suite["impls"]}
    jobs = []
    g = suite.get("grid")
    for p in grid_points(suite, quick, extended):
        name, wl = grid_workload(suite, p["model"], p["dtype"], p["tokens_per_rank"])
        for label in g["impls"]:
            jobs.append({"suite": suite["name"], "kind": "grid", "point": p, "impl": impls[label],
                         "backend": "sim", "cluster": p["cluster"], "ranks": None,
                         "workload": name, "workload_file": None, "workload_gen": wl,
                         "steps": g["workload_defaults"]["steps"], "trace": False,
                         "dest": f"{suite['out']}/{p['cluster']}/{name}-{label}"})
    for i, r in enumerate(suite.get("runs", [])):
        q = r.get("quick", False)
        if (quick and not q) or (r.get("extended") and not extended):
            continue
        over = quick and isinstance(q, dict)
        r = {**r, **q} if over else r
        clusters = r.get("clusters") or [None]
        ranks = r.get("ranks") or [None]
        if "models" in r:
            jobs += model_jobs(suite, r, clusters, ranks, impls)
            continue
        for j, spec in enumerate(r["workloads"]):
            where = f"runs[{i}]" + (".quick" if over and "workloads" in q else "") + f".workloads[{j}]"
            name, path, gen = resolve_workload(suite, spec, where)
            for label in r["impls"]:
                for cl in clusters:
                    for n in ranks:
                        jobs.append({"suite": suite["name"], "kind": "run", "run": r["id"], "impl": impls[label],
                                     "backend": r["backend"], "cluster": cl, "ranks": n,
                                     "workload": name, "workload_file": path, "workload_gen": gen,
                                     "steps": r.get("steps"), "trace": bool(r.get("trace")),
                                     "gemm_path": r.get("gemm_path"), "path_template": r["path"]})
    check_destinations(suite, jobs, quick)
    return jobs


def model_jobs(suite, r, clusters, ranks, impls):
    """The jobs of a run with "models" (whole models, moelab run --model): models x modes x
    implementations x clusters x ranks. A model file that is not in this checkout does not stop
    the suite: its jobs are kept and skipped, naming the file."""
    jobs = []
    for spec in r["models"]:
        e = mr.model_entry(spec)
        path = os.path.join(mr.EXPERIMENTS, "models", e["file"] + ".json")
        missing = None if os.path.exists(path) else \
            (f"no model file {rel_to(path, ROOT)} in this checkout (the runs stay in the suite and go once it exists)")
        for mode in mr.run_modes(r):
            for label in r["impls"]:
                for cl in clusters:
                    for n in ([e["ranks"]] if e.get("ranks") else ranks):
                        jobs.append({"suite": suite["name"], "kind": "run", "run": r["id"], "impl": impls[label],
                                     "backend": r["backend"], "cluster": cl, "ranks": n,
                                     "workload": e["file"], "workload_file": None, "workload_gen": None,
                                     "model_run": {"file": e["file"], "path": path, "missing": missing,
                                                   "model": e["model"], "override": e.get("override"),
                                                   "layers": e.get("layers"),
                                                   "micro_batch": e.get("micro_batch"),
                                                   "sequence_parallel": bool(e.get("sequence_parallel")),
                                                   "parallel": (e.get("parallel") or {}).get(cl),
                                                   "pipeline": mr.pipeline_of(r, e),
                                                   "run_mode": mode, "label": r.get("label") or label},
                                     "steps": r.get("steps"), "warmup": r.get("warmup"),
                                     "trace": bool(r.get("trace")), "gemm_path": r.get("gemm_path"),
                                     "path_template": r["path"]})
    return jobs


def check_destinations(suite, jobs, quick):
    """Two runs of a suite may not write one result file (the second would replace the first):
    a SchemaError naming the run whose "path" does not tell them apart."""
    seen = {}
    for j in jobs:
        if j["kind"] != "run":
            continue
        dest = destination(j, None, "{device}")
        if dest in seen:
            i = next(k for k, r in enumerate(suite["runs"]) if r["id"] == j["run"])
            raise mr.field_error(suite["_path"], f"runs[{i}]" + (".quick" if quick and isinstance(
                suite["runs"][i].get("quick"), dict) and "path" in suite["runs"][i]["quick"] else "") + ".path",
                f"{mr.show(j['path_template'])} gives {mr.show(dest + '.json')} to two runs (of {mr.show(seen[dest])} and "
                f"{mr.show(j['run'])}): "
                f"name what tells them apart ({', '.join('{' + f + '}' for f in mr.PATH_FIELDS)})")
        seen[dest] = j["run"]


def job_name(j):
    """What a job runs, as progress lines and --list print it: the workload, or the model file
    with its layers."""
    m = j.get("model_run")
    return j["workload"] + (f" [{m['layers']}]" if m and m["layers"] else "")


def job_label(j):
    m = j.get("model_run")
    return f"{m['label']} ({m['run_mode']})" if m else j["impl"]["label"]


# ---- what this machine can run --------------------------------------------------------------

def select_runs(plan, ids, quick, extended=False):
    """Keeps only the jobs of the runs named by ids (--run); drops suites left without any.
    Raises SchemaError for an id that no selected suite has (or that the quick subset, or the
    default run without --extended, leaves out)."""
    kept = []
    for s, jobs in plan:
        mine = [j for j in jobs if j["kind"] == "run" and j["run"] in ids]
        if mine:
            kept.append((s, mine))
    for rid in ids:
        if any(j["run"] == rid for _, jobs in kept for j in jobs):
            continue
        owners = [(s["name"], r) for s, _ in plan for r in s.get("runs", []) if r["id"] == rid]
        if owners and owners[0][1].get("extended") and not extended:
            raise mr.SchemaError(f"--run {rid}: the run of suite {owners[0][0]} is marked \"extended\": "
                                 f"add --extended" + (" and leave out --quick" if quick else ""))
        if owners and quick:
            raise mr.SchemaError(f"--run {rid}: the run of suite {owners[0][0]} is not in the quick subset "
                                 f"(its \"quick\" is false): leave out --quick")
        known = sorted({f"{s['name']}:{r['id']}" for s, _ in plan for r in s.get("runs", [])})
        raise mr.SchemaError(f"--run {rid}: no run with this id in the selected suites (runs: {', '.join(known)})")
    return kept


def select_workloads(plan, names):
    """Keeps only the jobs of these workloads (a run's workload, or a model run's model file:
    --workload, with --run), so that the runs of one id can be split over several calls; drops
    suites left without any. Raises SchemaError for a name no selected job has."""
    kept = [(s, [j for j in jobs if j["workload"] in names]) for s, jobs in plan]
    have = sorted({j["workload"] for _, jobs in plan for j in jobs})
    for n in names:
        if n not in have:
            raise mr.SchemaError(f"--workload {mr.show(n)}: no selected run has this workload "
                                 f"(they have: {', '.join(have) or 'none'})")
    return [(s, jobs) for s, jobs in kept if jobs]


def hostfile_slots(path):
    n = 0
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].split()
            if not line:
                continue
            slots = [w for w in line[1:] if w.startswith("slots=")]
            n += int(slots[0].split("=")[1]) if slots else 1
    return n


class Machine:
    def __init__(self, moelab, backends, hostfile):
        self.moelab = moelab
        self.backends = backends
        self.hostfile = hostfile
        self.mpirun = shutil.which("mpirun")
        self.cuda_line = "not checked"
        self.cuda_device = None
        p = subprocess.run([moelab, "list"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout.splitlines():
            if line.strip().startswith("cuda "):
                self.cuda_line = line.strip()
                if "cuda   available:" in line:
                    self.cuda_device = line.split("available:", 1)[1].strip()
        self.slots = hostfile_slots(hostfile) if hostfile else None
        # --cuda-profile: a `moelab calibrate --backend cuda` profile of this GPU; its measured
        # GEMM-path table is what the cuda runs choose their cuBLAS paths by (moelab run --profile).
        self.cuda_profile = None

    def why_not(self, job):
        """None if the job can run here, else why not."""
        b = job["backend"]
        if b not in self.backends:
            return f"backend {b} not selected (--backends {','.join(self.backends)})"
        if job["ranks"] == "hostfile":
            if not self.hostfile:
                return "needs a real cluster: pass --hostfile FILE (mpirun host list)"
        elif b == "cuda" and not self.cuda_device:  # the hosts of a host file have their own GPUs
            return f"no CUDA device here (moelab list: \"{self.cuda_line}\")"
        n = self.nranks(job)
        if n and n > 1 and not self.mpirun:
            return f"{n} ranks need mpirun, which is not installed"
        return None

    def nranks(self, job):
        return self.slots if job["ranks"] == "hostfile" else job["ranks"]


def run_moelab(cmd):
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        die(f"cannot start {cmd[0]}: {e.strerror}")


def tail_of(p, n=15):
    return "\n".join((p.stdout.strip().splitlines() + p.stderr.strip().splitlines())[-n:])


def probe(machine, impl, tmpdir, cluster):
    """Does the installed moelab accept impl's options? A one-rank sim run of a tiny layer."""
    wl = os.path.join(tmpdir, "probe.json")
    mr.write_json(wl, {"name": "probe", "model": {"d_model": 16, "d_hidden": 64, "num_experts": 8, "top_k": 1,
                                                   "capacity_factor": 0, "dtype": "fp32"},
                       "tokens_per_rank": 256, "steps": 1, "warmup": 1, "seed": 1})
    cmd = [machine.moelab, "run", "--workload", wl, "--impl", impl["impl"], "--impl-options",
           json.dumps(impl["options"]), "--backend", "sim", "--cluster", cluster, "--ranks", "1",
           "--out", os.path.join(tmpdir, "probe-out.json")]
    p = run_moelab(cmd)
    if p.returncode == 0:
        return None
    msg = (p.stderr.strip() or p.stdout.strip()).splitlines()
    msg = msg[-1] if msg else ""
    if p.returncode == 2 and f'"{impl["requires_option"]}"' in msg:
        return f"{impl.get('skip_note', 'skipped')} (moelab said: {msg})"
    die(f"the probe of {impl['label']} failed (exit code {p.returncode}):\n  {' '.join(cmd)}\n{tail_of(p)}", 1)


INFERENCE_NOTE = ("skipped: the installed moelab rejects --inference (the forward-only inference mode is not "
                  "built into this binary yet); rebuild moelab once it is and rerun")


def probe_inference(machine, tmpdir):
    """Does the installed moelab take --inference (a model's forward passes only)? A one-rank
    sim run of the tiny test model. None if it does, else the skip note; another failure stops."""
    cmd = [machine.moelab, "run", "--model", os.path.join(mr.EXPERIMENTS, "models", "tiny-moe.json"), "--impl",
           "fastmoe", "--backend", "sim", "--cluster", "dgx-a100x1", "--ranks", "1", "--steps", "1", "--warmup", "0",
           "--inference", "--out", os.path.join(tmpdir, "probe-inference.json")]
    p = run_moelab(cmd)
    if p.returncode == 0:
        return None
    msg = (p.stderr.strip() or p.stdout.strip()).splitlines()
    msg = msg[-1] if msg else ""
    if p.returncode == 2 and '"--inference"' in msg:
        return f"{INFERENCE_NOTE} (moelab said: {msg})"
    die(f"the probe of --inference failed (exit code {p.returncode}):\n  {' '.join(cmd)}\n{tail_of(p)}", 1)


# ---- one run --------------------------------------------------------------------------------

def destination(job, machine, device=None):
    """The result's path in the results folder, without ".json". {device} is the CUDA device
    class; for runs on the hosts of a host file it is known only from the result (device=).
    With machine None (checking a suite before any machine is known): ranks as the suite gives
    them and device as given."""
    if job["kind"] == "grid":
        return job["dest"]
    if machine is None:
        dev, ranks = device, job["ranks"] or 1
    else:
        dev = mr.slug(mr.device_class(device or (machine.cuda_device if job["backend"] == "cuda" else None)
                                      or "unknown"))
        ranks = machine.nranks(job) or 1
    mrun = job.get("model_run") or {}
    return job["path_template"].format(workload=job["workload"], impl=job["impl"]["label"], ranks=ranks,
                                       cluster=job["cluster"] or "", backend=job["backend"], device=dev,
                                       model=mrun.get("model", job["workload"]),
                                       label=mrun.get("label", job["impl"]["label"]),
                                       run_mode=mrun.get("run_mode", "training"))


def move_result(stage, old, new):
    for ext in (".json", ".trace.json"):
        if os.path.exists(os.path.join(stage, old + ext)):
            os.makedirs(os.path.dirname(os.path.join(stage, new + ext)), exist_ok=True)
            os.replace(os.path.join(stage, old + ext), os.path.join(stage, new + ext))


def command(job, machine, wl_path, dest):
    im = job["impl"]
    mrun = job.get("model_run")
    if mrun:
        cmd = [machine.moelab, "run", "--model", mrun["path"], "--impl", im["impl"]]
    else:
        cmd = [machine.moelab, "run", "--workload", wl_path, "--impl", im["impl"]]
    if im["options"]:
        cmd += ["--impl-options", json.dumps(im["options"], separators=(",", ":"))]
    if mrun:
        if mrun["override"]:
            cmd += ["--model-override", json.dumps(mrun["override"], separators=(",", ":"))]
        if mrun["layers"]:
            cmd += ["--layers", mrun["layers"]]
        if mrun.get("micro_batch"):
            cmd += ["--micro-batch", str(mrun["micro_batch"])]
        if mrun.get("sequence_parallel"):
            cmd += ["--sequence-parallel"]
        if mrun["parallel"]:
            cmd += ["--parallel", mrun["parallel"]]
        cmd += mr.pipeline_flags(mrun.get("pipeline"))
        if job.get("warmup") is not None:
            cmd += ["--warmup", str(job["warmup"])]
        if mrun["run_mode"] == "inference":
            cmd += ["--inference"]
    cmd += ["--backend", job["backend"]]
    if job["backend"] == "cuda" and getattr(machine, "cuda_profile", None):
        cmd += ["--profile", machine.cuda_profile]
    # The run's own "gemm_path" (an ablation inside the suite), else --gemm-path over the others.
    gemm_path = job.get("gemm_path") or getattr(machine, "gemm_path", None)
    if job["backend"] in ("cuda", "sim") and gemm_path:
        cmd += ["--gemm-path", gemm_path]
    if job["cluster"]:
        cmd += ["--cluster", job["cluster"]]
    n = machine.nranks(job)
    if job["backend"] == "sim" and n:
        cmd += ["--ranks", str(n)]
    if job["steps"]:
        cmd += ["--steps", str(job["steps"])]
    cmd += ["--out", dest + ".json"]
    if job["trace"]:
        cmd += ["--trace", dest + ".trace.json"]
    if job["backend"] != "sim" and n and (n > 1 or job["ranks"] == "hostfile"):
        launch = [machine.mpirun] + (["--hostfile", machine.hostfile] if machine.hostfile and job["ranks"] == "hostfile"
                                     else ["--oversubscribe"]) + ["-np", str(n)]
        cmd = launch + cmd
    return cmd


def figures(res):
    """The figures of one result that a summary keeps (see docs/RESULTS-SCHEMA.md)."""
    m = res["metrics"]
    rep = res.get("impl_report") or {}
    n = rep.get("last_n", rep.get("partitions"))
    out = {"step_time_s": m["step_time_s"]["median"],
           "peak_memory_bytes": m["peak_memory_bytes"]["device_total"],
           "overlap_ratio": m["overlap_ratio"],
           "comm_s": m["comm_s"],
           "compute_busy_s": m["compute_busy_s"],
           "exposed_comm_s": m["exposed_comm_s"],
           "overlap_limit_s": m["overlap_limit_s"],
           "phases_s": m["phases_s"]}
    opt = m["peak_memory_bytes"].get("optimizer_state")
    if opt:  # the peak with the optimizer's state (the run's own, or Adam's added)
        out["peak_memory_with_optimizer_bytes"] = opt["with"]
        out["peak_memory_without_optimizer_bytes"] = opt["without"]
    if n is not None:
        out["partitions"] = n
    strategy = rep.get("last_strategy", rep.get("strategy"))  # the one used when "auto"
    if strategy is not None:
        out["strategy"] = strategy
    if "chosen_cost_s" in rep:  # Eq. 10's cost of that strategy for one partition
        out["eq10_cost_per_partition_s"] = rep["chosen_cost_s"]
    if m.get("gemm_path_forced"):  # moelab run --gemm-path: an ablation or a replay, not the chosen paths
        out["gemm_path_forced"] = m["gemm_path_forced"]
    return out


def model_figures(res, a2a_overlap=None, pipelined=False):
    """figures() of a whole-model run (a suite run with "models") and what a ScMoE comparison
    adds: the all-to-all's share of the MoE phases' op time and, from the run's trace, the
    all-to-all's own overlap ratio; with pipelined (the run gives "pipeline" flags) the
    pipeline's figures as well (mr.pipeline_figures; docs/RESULTS-SCHEMA.md)."""
    out = figures(res)
    if pipelined:
        out.update(mr.pipeline_figures(res))
    # The MoE layers' exchanges: the all-to-alls' streams and the TP all-gathers' lane, busy time
    # summed (what they would take one after the other).
    busy = res["metrics"].get("stream_busy_s") or {}
    out["exchange_s"] = sum(busy.get(k, 0.0) for k in ("dispatch", "combine", "tp_gather"))
    out["all_to_all_s"] = sum(busy.get(k, 0.0) for k in ("dispatch", "combine"))
    rep = res.get("impl_report") or {}
    if isinstance(rep.get("chunks"), int):
        out["chunks"] = rep["chunks"]
    choice = rep.get("chunks_choice")
    if isinstance(choice, dict) and isinstance(choice.get("layouts"), dict):
        out["layouts"] = choice["layouts"]
    share = mr.all_to_all_share(res["metrics"]["phases_s"])
    if share is not None:
        out["all_to_all_share"] = share
    if a2a_overlap is not None:
        out["all_to_all_overlap"] = a2a_overlap
    return out


# ---- the summary ----------------------------------------------------------------------------

def comparisons(results, systems, baselines):
    """Speed-up, memory saving (the tracked peak) and, where both results give it, the memory
    saving with the optimizer's state (peak_memory_with_optimizer_bytes), per system_vs_baseline."""
    sp, ms, mso = {}, {}, {}
    for s in systems:
        for b in baselines:
            if s in results and b in results:
                rs, rb = results[s], results[b]
                sp[f"{s}_vs_{b}"] = rb["step_time_s"] / rs["step_time_s"]
                ms[f"{s}_vs_{b}"] = 1.0 - rs["peak_memory_bytes"] / rb["peak_memory_bytes"]
                if "peak_memory_with_optimizer_bytes" in rs and "peak_memory_with_optimizer_bytes" in rb:
                    mso[f"{s}_vs_{b}"] = 1.0 - rs["peak_memory_with_optimizer_bytes"] / rb["peak_memory_with_optimizer_bytes"]
    return sp, ms, mso


def judge(metric, v, paper, tol, paper_range=None):
    """(direction agrees, size agrees, verdict) of ours (v) against the paper's figure. Direction,
    for a comparison of a system with a baseline: faster (speed-up > 1) or smaller (memory
    saving > 0); one system's figure (a share, an overlap ratio) has none (None). Size: within
    tol of the paper's figure (relative), or of its range [low, high] when the claim gives one;
    a speed-up is judged on its gain (speed-up − 1: "+30%" against ours, so that 1.04x does not
    pass for the paper's 1.30x), every other figure as it is (a saving, a share, a ratio)."""
    gain = metric in mr.GAIN_METRICS
    f = (lambda x: x - 1.0) if gain else (lambda x: x)
    if paper_range:
        lo, hi = f(paper_range[0]), f(paper_range[1])
        size = lo - tol * abs(lo) <= f(v) <= hi + tol * abs(hi)
    else:
        size = abs(f(v) - f(paper)) <= tol * abs(f(paper))
    off = (f"ours is a {100 * (v - 1):+.0f}% gain against the paper's {100 * (paper - 1):+.0f}%" if gain
           else f"ours is {v / paper:.2f}x the paper's figure")
    if metric not in mr.PAIR_METRICS or metric in mr.UNDIRECTED_METRICS:
        return None, size, ("agrees in size" if size else off)
    up = v > 1.0 if gain else v > 0.0
    size = size and up  # a figure on the wrong side of no change agrees in no size
    verdict = ("agrees in direction and size" if size else
               f"agrees in direction, {off}" if up else
               "disagrees in direction")
    return up, size, verdict


def run_claim(item, runs, tol):
    """One claim judged on the summary's whole-model runs (a claim with "on": "runs")."""
    systems = [item["system"]] if isinstance(item["system"], str) else list(item["system"])
    used = []
    vals = mr.run_comparisons(runs, systems, item.get("versus"), item["metric"], item.get("select"), used)
    missing = mr.run_comparison_gaps(runs, systems, item.get("versus"), item["metric"], item.get("select"))
    row = dict(item)
    # measured, simulated or mixed: the runs the claim was judged on (each system run and the
    # baseline run paired with it), not the summary's other runs
    modes = {r.get("mode") for r in used}
    row["mode"] = modes.pop() if len(modes) == 1 else "mixed" if modes else "simulated"
    row["compared_on"] = "runs"
    if not vals:
        row["ours"] = {"runs": {"points": 0, **({"missing": missing} if missing else {})}}
        row["direction_agrees"] = row["size_agrees"] = None
        row["verdict"] = (f"not run (no selected run of {', '.join(systems)}"
                          + (f" with a {item['versus']} run beside it" if item.get("versus") else "") + ")")
        return row
    xs = [v for _, v in vals]
    stat = {"max": max, "min": min, "mean": lambda a: sum(a) / len(a)}[item["stat"]]
    row["ours"] = {"runs": {"points": len(xs), "value": stat(xs), "max": max(xs), "mean": sum(xs) / len(xs),
                            "min": min(xs), "used": [f"{n}: {mr.fmt_claim(item['metric'], v)}" for n, v in vals]}}
    row["direction_agrees"], row["size_agrees"], row["verdict"] = judge(
        item["metric"], row["ours"]["runs"]["value"], item["paper"], tol, item.get("paper_range"))
    if missing:
        # Judged without them: the figure is the stat over fewer points than the claim selects
        # (a worst point may be among the missing), and the verdict says so.
        row["ours"]["runs"]["missing"] = missing
        row["verdict"] += (f" (on {len(xs)} of {len(xs) + len(missing)} selected points; without "
                           + "; ".join(missing) + ")")
    return row


# How a memory claim counts the peak (a claim's "memory_counts"): the tracked allocator's peak
# (weights, gradients, activations, buffers; an optimizer's state only where the run has one),
# or that peak with the optimizer's state (the run's own, or Adam's added; docs/RESULTS-SCHEMA.md).
MEMORY_FIELDS = {"tracked": "memory_saving", "with_optimizer_state": "memory_saving_with_optimizer"}


def judge_grid_claim(item, key, field, points, in_setup, tol):
    """ours (on the paper's setup and on every point), compared_on, and the verdict of one claim
    on the grid's points for one system_vs_baseline key and one figure (speedup or a saving)."""
    out = {"ours": {}}
    for scope, keep in (("paper_setup", in_setup), ("all_points", lambda p: True)):
        vals = [p[field][key] for p in points if keep(p) and key in (p.get(field) or {})]
        if not vals:
            out["ours"][scope] = {"points": 0}
            continue
        v = max(vals) if item["stat"] == "max" else min(vals) if item["stat"] == "min" else sum(vals) / len(vals)
        out["ours"][scope] = {"points": len(vals), "value": v, "max": max(vals),
                              "mean": sum(vals) / len(vals), "min": min(vals)}
    best = out["ours"]["paper_setup"] if out["ours"]["paper_setup"]["points"] else out["ours"]["all_points"]
    out["compared_on"] = "paper_setup" if out["ours"]["paper_setup"]["points"] else "all_points"
    if not best["points"]:
        out["direction_agrees"] = None
        out["size_agrees"] = None
        out["verdict"] = f"not run ({key.replace('_vs_', ' against ')}: no result in this run)"
    else:
        out["direction_agrees"], out["size_agrees"], out["verdict"] = judge(
            "speedup" if field == "speedup" else "memory_saving", best["value"], item["paper"], tol)
    return out


def claims_table(suite, points, runs=()):
    c = suite.get("claims")
    if not c:
        return []
    tol = c["size_tolerance"]
    setup = c.get("paper_setup") or {}
    in_setup = (lambda p: all(p.get(k) == v for k, v in setup.items())) if setup else (lambda p: False)
    rows = []
    for item in c["items"]:
        if item.get("on") == "runs":
            rows.append(run_claim(item, runs, tol))
            continue
        field = "speedup" if item["metric"] == "speedup" else MEMORY_FIELDS[item.get("memory_counts", "tracked")]
        row = dict(item)
        row["mode"] = "simulated"  # claims are judged on the grid, which runs on the sim backend
        row["paper_setup"] = setup
        judged = judge_grid_claim(item, f"{item['system']}_vs_{item['versus']}", field, points, in_setup, tol)
        row.update(judged)
        # The same claim against the baseline as its published code ran (claims.as_published maps
        # a baseline's label to its as-published variant's).
        pub = (c.get("as_published") or {}).get(item["versus"])
        if pub:
            row["as_published"] = {"versus": pub,
                                   **judge_grid_claim(item, f"{item['system']}_vs_{pub}", field, points, in_setup, tol)}
        # A memory claim also shows the other way of counting (with / without the optimizer's state).
        if item["metric"] != "speedup":
            other = "tracked" if item.get("memory_counts", "tracked") != "tracked" else "with_optimizer_state"
            alt = judge_grid_claim(item, f"{item['system']}_vs_{item['versus']}", MEMORY_FIELDS[other], points,
                                   in_setup, tol)
            row["other_counting"] = {"memory_counts": other, "ours": alt["ours"], "verdict": alt["verdict"]}
        rows.append(row)
    return rows


def summarize(suite, jobs, subset, host_seconds, judge_claims=True):
    """The suite's moelab.suite-summary/1 from its finished jobs (its claims judged unless
    judge_claims is false: a partial run, --run, whose claims nobody reads)."""
    grid_impls = suite["grid"]["impls"] if suite.get("grid") else []
    by_label = {im["label"]: im for im in suite["impls"]}
    systems = [l for l in grid_impls if by_label[l]["kind"] == "system"]
    baselines = [l for l in grid_impls if by_label[l]["kind"] == "baseline"]
    points, runs = {}, []
    done = [j["result"] for j in jobs if j.get("result") is not None]
    modes = {r["mode"] for r in done}
    sim = [r for r in done if r["mode"] == "simulated"]
    for j in jobs:
        res = j.get("result")
        if j["kind"] == "grid":
            p = points.setdefault(id(j["point"]), {**j["point"], "results": {}, "failed": {}, "skipped": []})
            if res is not None:
                p["results"][j["impl"]["label"]] = {**figures(res), "file": j["file"]}
            elif j.get("failed"):
                p["failed"][j["impl"]["label"]] = j["failed"]
            elif j.get("oom"):
                p.setdefault("out_of_memory", {})[j["impl"]["label"]] = j["oom"]
            elif j.get("skipped"):
                p["skipped"].append(j["impl"]["label"])
            continue
        row = {"id": j["run"], "impl": j["impl"]["label"], "impl_name": j["impl"]["impl"],
               "options": j["impl"]["options"], "workload": j["workload"], "backend": j["backend"],
               "cluster": j["cluster"], "ranks": j["ranks"]}
        mrun = j.get("model_run")
        if mrun:
            row.update(model=mrun["model"], model_file=mrun["file"], layers=mrun["layers"], label=mrun["label"],
                       run_mode=mrun["run_mode"], parallel=mrun["parallel"], override=mrun["override"])
            if mrun.get("micro_batch"):
                row["micro_batch"] = mrun["micro_batch"]
            if mrun.get("sequence_parallel"):
                row["sequence_parallel"] = True
            if mrun.get("pipeline"):
                row["pipeline"] = mrun["pipeline"]
        if res is not None:
            row.update(mode=res["mode"], device=res["device"], calibration=res["calibration"],
                       world_size=res["world_size"], file=j["file"],
                       results=model_figures(res, j.get("a2a_overlap"), bool(mrun.get("pipeline")))
                       if mrun else figures(res))
        elif j.get("failed"):
            row.update(skipped=f"failed: {j['failed']}", failed=True)
        elif j.get("oom"):
            row.update(skipped=f"out of device memory: {j['oom']}", out_of_memory=True)
        else:
            row["skipped"] = j.get("skipped") or "not run"
        runs.append(row)
    rows = []
    for p in points.values():
        sp, ms, mso = comparisons(p["results"], systems, baselines)
        if not p["failed"]:
            del p["failed"]
        rows.append({**p, "speedup": sp, "memory_saving": ms,
                     **({"memory_saving_with_optimizer": mso} if mso else {})})
    skipped = {}
    for j in jobs:
        if j.get("skipped"):
            what = (f"impl {j['impl']['label']}" if j["kind"] == "grid" else f"run {j['run']}")
            key = (what, j["skipped"])
            skipped[key] = skipped.get(key, 0) + 1
    summary = {
        "schema": mr.SUMMARY_SCHEMA,
        "suite": suite["name"],
        "suite_file": rel_to(os.path.abspath(suite["_path"]), ROOT),
        "subset": subset,
        "mode": "none" if not modes else modes.pop() if len(modes) == 1 else "mixed",
        "backends": sorted({j["backend"] for j in jobs if j.get("result") is not None}),
        "calibration": sim[0]["calibration"] if sim else None,
        "routing_model": sim[0].get("routing_model") if sim else None,
        "commit": done[0]["commit"] if done else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_seconds": round(host_seconds, 1),
        "paths": "every \"file\" is relative to the results folder",
        "definitions": {
            "speedup": "step time of the baseline / step time of the system (one forward + backward of the MoE layer, slowest rank)",
            "memory_saving": "1 - peak device memory of the system / that of the baseline (the highest rank's peak over the timed step as the tracked allocator counts it: weights, gradients, activations and buffers; an optimizer's state only where the run has an optimizer, which an MoE layer's forward + backward has not)",
            "memory_saving_with_optimizer": "the same with the optimizer's state in both peaks: the run's own optimizer's, or, for a run without one, Adam's state for the rank's parameters added (fp32: m and v, 2 x the parameters' bytes; 16-bit: fp32 master, m and v, 12 bytes per parameter, ZeRO section 3.1); metrics.peak_memory_bytes.optimizer_state",
            "as_published": "a claim's figure against the baseline as its published code ran (claims.as_published maps the baseline's label to that variant's), beside the figure against the ideal baseline",
            "partitions": "n used in the timed step (impl_report.last_n); chosen by the online granularity search for \"partitions\": \"auto\"",
            "overlap_ratio": "communication hidden behind computation / all communication, summed over ranks",
            **({"whole-model runs": "runs with a model, run_mode and label: a step is one training step of the "
                                    "model (forward, backward, gradient all-reduce, optimizer) or, in inference, its "
                                    "forward passes; a claim on runs pairs a system's run with the baseline's run of "
                                    "the same model, layers, cluster and run mode",
                "all_to_all_share": "(dispatch + combine) / (gate + dispatch + experts + combine) phase op time of "
                                    "the MoE layers",
                "all_to_all_overlap": "all-to-all time hidden behind compute-stream ops / all-to-all time, summed "
                                      "over ranks, from the run's trace (traced runs only; the gradient all-reduce "
                                      "left out, which overlap_ratio counts)"}
               if any(j.get("model_run") for j in jobs) else {}),
        },
        "dtype_notes": (suite.get("grid") or {}).get("dtype_notes"),
        "tokens_rule": (suite.get("grid") or {}).get("tokens_rule"),
        "skipped": [{**({"impl": w[5:]} if w.startswith("impl ") else {"run": w[4:]}), "reason": why, "count": n}
                    for (w, why), n in skipped.items()],
        "points": rows,
        "runs": runs,
        "claims": claims_table(suite, rows, runs) if judge_claims else [],
    }
    return summary


def print_tables(suite, summary):
    s = summary
    grid_impls = suite["grid"]["impls"] if suite.get("grid") else []
    if s["points"]:
        shown = [l for l in grid_impls if any(l in p["results"] for p in s["points"])]
        print(f"\n{'cluster':11} {'model':12} {'dtype':5} {'B':>6}  " + "  ".join(f"{l:>9}" for l in shown) +
              "   ms/step; speed-up and memory saving of each system vs each baseline")
        for r in s["points"]:
            ts = "  ".join(f"{r['results'][l]['step_time_s'] * 1e3:9.2f}" if l in r["results"] else f"{'-':>9}"
                           for l in shown)
            ext = "; ".join(f"{k.replace('_vs_', '/')} {v:.2f}x {100 * r['memory_saving'][k]:+.0f}%"
                            for k, v in r["speedup"].items())
            print(f"{r['cluster']:11} {r['model']:12} {r['dtype']:5} {r['tokens_per_gpu']:>6}  {ts}   {ext}")
    model_runs = [r for r in s["runs"] if r.get("run_mode")]
    if model_runs:
        ww = max([16] + [len(r["model_file"]) + (len(r["layers"]) + 3 if r.get("layers") else 0) for r in model_runs])
        print(f"\n{'run':14} {'model file':{ww}} {'label':15} {'where':11} {'mode':9} {'ms/step':>9} {'overlap':>7} "
              f"{'a2a/MoE':>7} {'peak GiB':>8}")
        for r in model_runs:
            mf = r["model_file"] + (f" [{r['layers']}]" if r.get("layers") else "")
            where = r["cluster"] or (f"np {r['ranks']}" if r["ranks"] else "")
            if "results" in r:
                f = r["results"]
                share = f"{100 * f['all_to_all_share']:6.0f}%" if "all_to_all_share" in f else f"{'-':>7}"
                print(f"{r['id']:14} {mf:{ww}} {r['label']:15} {where:11} {r['run_mode']:9} "
                      f"{f['step_time_s'] * 1e3:9.2f} {100 * f['overlap_ratio']:6.0f}% {share} "
                      f"{f['peak_memory_bytes'] / 2**30:8.2f}")
            else:
                print(f"{r['id']:14} {mf:{ww}} {r['label']:15} {where:11} {r['run_mode']:9} "
                      f"{'skipped' if not r.get('out_of_memory') else 'out of device memory'}")
    layer_runs = [r for r in s["runs"] if not r.get("run_mode")]
    if layer_runs:
        ww = max([16] + [len(r["workload"]) for r in layer_runs])
        print(f"\n{'run':16} {'workload':{ww}} {'impl':15} {'backend':8} {'where':11} {'mode':9} "
              f"{'ms/step':>9} {'overlap':>7} {'peak MiB':>9}")
        for r in layer_runs:
            where = r["cluster"] or (f"np {r['ranks']}" if r["ranks"] else "")
            if "results" in r:
                f = r["results"]
                print(f"{r['id']:16} {r['workload']:{ww}} {r['impl']:15} {r['backend']:8} {where:11} {r['mode']:9} "
                      f"{f['step_time_s'] * 1e3:9.3f} {100 * f['overlap_ratio']:6.0f}% "
                      f"{f['peak_memory_bytes'] / 2**20:9.1f}")
            else:
                print(f"{r['id']:16} {r['workload']:{ww}} {r['impl']:15} {r['backend']:8} {where:11} "
                      f"skipped: {r['skipped']}")
    if s["claims"]:
        print("\nclaims (paper vs ours):")
        for r in s["claims"]:
            o = r["ours"][r["compared_on"]]
            fmtv = lambda v, m=r["metric"]: mr.fmt_claim(m, v)  # noqa: E731
            ours = fmtv(o["value"]) if o["points"] else "-"
            print(f"  {r['text'][:60]:60} {fmtv(r['paper']):>7} {ours:>7} {o['points']:>4}  {r['verdict']}")
            pub = r.get("as_published")
            if pub:
                po = pub["ours"][pub["compared_on"]]
                print(f"      vs {pub['versus']}: {fmtv(po['value']) if po['points'] else '-'}  {pub['verdict']}")
            for u in o.get("used", []) if o["points"] else []:
                print(f"      {u}")


# ---- main -----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--suite", action="append", help="a suite's name or file (repeatable; default: every "
                                                     "experiments/*/suite.json)")
    ap.add_argument("--quick", action="store_true", help="each suite's reduced subset")
    ap.add_argument("--extended", action="store_true",
                    help="also the grid sweeps and runs marked \"extended\" (brackets and cross-checks beside the paper's setup)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results"), help="the results folder (default results/)")
    ap.add_argument("--moelab", default=os.environ.get("MOELAB", os.path.join(ROOT, "build", "harness", "moelab")),
                    help="the moelab binary (default $MOELAB, else build/harness/moelab)")
    ap.add_argument("--backends", default="sim,cpu,cuda", help="comma-separated backends to run (default all)")
    ap.add_argument("--hostfile", help="an mpirun host file: runs with \"hostfile\" ranks use one rank per slot")
    ap.add_argument("--cuda-profile", metavar="FILE",
                    help="a `moelab calibrate --backend cuda` profile of this GPU: the cuda runs choose their GEMM "
                         "paths by its measured table (moelab run --profile)")
    ap.add_argument("--gemm-path", choices=("loop", "strided_batched", "grouped"),
                    help="the cuda and sim runs' expert GEMMs pinned to this cuBLAS path where it can run (moelab run "
                         "--gemm-path; a run with its own \"gemm_path\" keeps it): an ablation, or a replay of a build "
                         "that always took one path; needs --run and an --out other than the repository's results/, "
                         "and excludes --update-baseline (the suite's results choose their paths)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="simulated runs at a time (default: the number of cores); measured runs always run alone")
    ap.add_argument("--update-baseline", action="store_true",
                    help="write simulated results that differ from those in --out over them (except those a "
                         "committed summary lists that this run does not rewrite: a partial --run, or a smaller "
                         "subset than the committed summary's that differs from it)")
    ap.add_argument("--list", action="store_true", help="print the runs and exit")
    ap.add_argument("--run", action="append", metavar="ID",
                    help="only the runs with this id (repeatable); the grid is left out and no summary is written")
    ap.add_argument("--workload", action="append", metavar="NAME",
                    help="with --run: only those runs' jobs of this workload or model file (repeatable), to split "
                         "the runs of one id over several calls")
    a = ap.parse_args()
    if a.quick and a.extended:
        ap.error("--quick and --extended: choose one (quick is a subset of the default run, extended a superset)")
    if a.workload and not a.run:
        ap.error("--workload selects among the jobs of --run ID: give the run id too")
    if a.gemm_path and (not a.run or a.update_baseline
                        or os.path.realpath(a.out) == os.path.realpath(os.path.join(ROOT, "results"))):
        ap.error("--gemm-path needs --run ID and an --out other than the repository's results/, and excludes "
                 "--update-baseline: a forced path is an ablation of some runs, and its results would take the "
                 "place of the suite's own")

    backends = [b for b in a.backends.split(",") if b]
    for b in backends:
        if b not in mr.BACKENDS:
            die(f"--backends: unknown backend \"{b}\" (expected {', '.join(mr.BACKENDS)})")
    try:
        suites = [mr.load_suite(s) for s in (a.suite or mr.registered_suites())]
        for s in suites:
            check_quick_subset(s)
        plan = [(s, expand(s, a.quick, a.extended)) for s in suites]
        if a.run:
            plan = select_runs(plan, a.run, a.quick, a.extended)
            if a.workload:
                plan = select_workloads(plan, a.workload)
            suites = [s for s, _ in plan]
    except mr.SchemaError as e:
        die(str(e))
    if not suites:
        die(f"no suites under {mr.EXPERIMENTS}")
    subset = "quick" if a.quick else "extended" if a.extended else "full"
    out = os.path.abspath(a.out)
    stage = os.path.join(out, "candidate")

    if a.list:
        for s, jobs in plan:
            for j in jobs:
                where = j["cluster"] or f"np {j['ranks']}"
                print(f"{s['name']:12} {j['kind']:4} {j['backend']:4} {where:11} {job_name(j):28} {job_label(j)}")
            print(f"{s['name']}: {len(jobs)} runs ({subset}" + (f", --run {','.join(a.run)}" if a.run else "") + ")")
        return
    if not (os.path.isfile(a.moelab) and os.access(a.moelab, os.X_OK)):
        die(f"no moelab binary at {a.moelab}: build it (cmake --build build --target moelab) or pass --moelab PATH")
    if a.hostfile and not os.path.isfile(a.hostfile):
        die(f"--hostfile {a.hostfile}: no such file")
    if a.cuda_profile and not os.path.isfile(a.cuda_profile):
        die(f"--cuda-profile {a.cuda_profile}: no such file")
    # The cluster catalogue of this checkout, also for a binary built in another one (scripts/gpu.sh).
    os.environ.setdefault("MOELAB_EXPERIMENTS", mr.EXPERIMENTS)
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    machine = Machine(a.moelab, backends, a.hostfile)
    if a.cuda_profile:
        machine.cuda_profile = os.path.abspath(a.cuda_profile)
    machine.gemm_path = a.gemm_path

    # What cannot run here, and the implementations this binary lacks options for.
    with tempfile.TemporaryDirectory(prefix="run_suite.") as tmp:
        probed = {}
        for s, jobs in plan:
            for j in jobs:
                why = machine.why_not(j)
                im = j["impl"]
                mrun = j.get("model_run")
                if not why and mrun and mrun["missing"]:
                    why = mrun["missing"]
                if not why and mrun and mrun["run_mode"] == "inference":
                    if " --inference" not in probed:
                        probed[" --inference"] = probe_inference(machine, tmp)
                    why = probed[" --inference"]
                if not why and im.get("requires_option"):
                    key = (s["name"], im["label"])
                    if key not in probed:
                        probed[key] = probe(machine, im, tmp, j["cluster"] or "dgx-a100x1")
                    why = probed[key]
                j["skipped"] = why
    todo = [j for _, jobs in plan for j in jobs if not j["skipped"]]
    total = len(todo)
    lock = lock_out(out)  # held until exit: the staging folder below is this run's alone
    if os.path.isdir(stage):
        shutil.rmtree(stage)
    print(f"run_suite.py: {len(suites)} suite(s) ({subset}): {total} runs, "
          f"{sum(1 for _, js in plan for j in js if j['skipped'])} skipped; moelab {a.moelab}; "
          f"results under {rel_to(out, ROOT)} (new runs first under {rel_to(stage, ROOT)})")
    for s, jobs in plan:
        reasons = {}
        for j in jobs:
            if j["skipped"]:
                reasons.setdefault((j.get("run") or f"grid {j['impl']['label']}", j["skipped"]), []).append(j)
        for (what, why), js in reasons.items():
            print(f"  [{s['name']}] skipped {what} ({len(js)} runs): {why}")

    start = time.time()
    cost = {}  # (suite, backend, cluster or ranks, impl label) -> host seconds so far
    count = {"all": 0}
    failed = []
    workers = max(1, a.jobs)

    def group(j):
        return (j["suite"], j["backend"], j["cluster"] or j["ranks"], j["impl"]["label"])

    def prepare(s, j):
        dest_rel = destination(j, machine)
        if j["workload_gen"] is not None:
            wl_path = os.path.join(stage, s["out"], "workloads", j["workload"] + ".json")
            if not os.path.exists(wl_path):
                mr.write_json(wl_path, j["workload_gen"])
        else:
            wl_path = j["workload_file"]
        os.makedirs(os.path.dirname(os.path.join(stage, dest_rel)), exist_ok=True)
        return dest_rel, command(j, machine, wl_path, os.path.join(stage, dest_rel))

    def execute(j, dest_rel, cmd):
        t0 = time.time()
        p = run_moelab(cmd)
        return j, dest_rel, cmd, p, time.time() - t0

    def time_left():
        """Host seconds still to go: the mean of each (suite, platform, impl) so far, else of all;
        simulated runs go `workers` at a time."""
        elapsed = time.time() - start
        mean_all = elapsed / max(count["all"], 1)
        sim = alone = 0.0
        for q in todo:
            if q.get("finished"):
                continue
            c = cost.get(group(q))
            t = sum(c) / len(c) if c else mean_all
            if q["backend"] == "sim":
                sim += t
            else:
                alone += t
        return sim / workers + alone

    def finish(s, counter, j, dest_rel, cmd, p, dt):
        j["finished"] = True
        count["all"] += 1
        counter["done"] += 1
        cost.setdefault(group(j), []).append(dt)
        dest = os.path.join(stage, dest_rel)
        what = f"{j['cluster'] or j['backend'] + (' np ' + str(machine.nranks(j)) if machine.nranks(j) else '')} " \
               f"{job_name(j)} {job_label(j)}"
        if p.returncode == 3:
            # The configuration does not fit the (simulated) device: a finding, not a failure.
            j["oom"] = (p.stderr.strip() or f"exit code {p.returncode}").splitlines()[-1]
            line = f"OUT OF DEVICE MEMORY: {j['oom']}"
        elif p.returncode != 0:
            j["failed"] = (p.stderr.strip() or p.stdout.strip() or f"exit code {p.returncode}").splitlines()[-1]
            failed.append((s["name"], what, " ".join(cmd), tail_of(p)))
            line = f"FAILED (exit code {p.returncode}): {j['failed']}"
        else:
            try:
                res = mr.load_result(dest + ".json")
            except mr.SchemaError as e:
                j["failed"] = str(e)
                failed.append((s["name"], what, " ".join(cmd), str(e)))
                res = None
                line = f"FAILED: {e}"
            if res is not None:
                if "{device}" in j.get("path_template", "") and not machine.cuda_device:
                    moved = destination(j, machine, res["device"])
                    move_result(stage, dest_rel, moved)
                    dest_rel = moved
                j["result"] = res
                j["file"] = dest_rel + ".json"
                if j.get("model_run") and j["trace"] and os.path.exists(dest + ".trace.json"):
                    try:
                        j["a2a_overlap"] = mr.all_to_all_overlap(dest + ".trace.json")
                    except mr.SchemaError as e:
                        print(f"run_suite.py: {e} (the run's all-to-all overlap is left out)", file=sys.stderr)
                f = figures(res)
                n = f", n={f['partitions']}" if "partitions" in f and j["impl"]["impl"] == "mpipemoe" else ""
                pk = f["peak_memory_bytes"]
                pk = f"{pk / 2**30:.2f} GiB" if pk >= 2**30 else f"{pk / 2**20:.1f} MiB"
                line = f"{res['mode']}, step {f['step_time_s'] * 1e3:.2f} ms, peak {pk}{n}"
        print(f"[{s['name']} {subset} {counter['done']}/{counter['total']} | all {count['all']}/{total}] {what}: "
              f"{line} ({dt:.1f} s) | elapsed {fmt_s(time.time() - start)}, about {fmt_s(time_left())} left",
              flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for s, jobs in plan:
            t_suite = time.time()
            runnable = [j for j in jobs if not j["skipped"]]
            counter = {"done": 0, "total": len(runnable)}
            i = 0
            while i < len(runnable):
                if runnable[i]["backend"] != "sim":
                    # A measured run runs alone: nothing else competes for the machine it times.
                    finish(s, counter, *execute(runnable[i], *prepare(s, runnable[i])))
                    i += 1
                    continue
                batch = []
                while i < len(runnable) and runnable[i]["backend"] == "sim":
                    batch.append(pool.submit(execute, runnable[i], *prepare(s, runnable[i])))
                    i += 1
                for fut in concurrent.futures.as_completed(batch):
                    finish(s, counter, *fut.result())
            try:
                summary = summarize(s, jobs, suite_subset(s, subset), time.time() - t_suite, judge_claims=not a.run)
            except mr.SchemaError as e:
                # The suite's claims cannot be judged on these runs: no summary for it, a failure;
                # its finished results and the other suites' still go through the merge below.
                failed.append((s["name"], "judging its claims", "(summary not written)", str(e)))
                print(f"\n[{s['name']}] summary: not written: {e}\n")
                continue
            mr.check_summary(summary, "(the summary being written)")
            if not a.run:
                mr.write_json(mr.summary_path(s, stage), summary)
            print_tables(s, {**summary, "claims": []} if a.run else summary)  # claims are judged on whole runs
            where = (f"not written (--run {','.join(a.run)}: a partial run)" if a.run
                     else rel_to(mr.summary_path(s, out), ROOT))
            print(f"\n[{s['name']}] summary: {where} ({counter['total']} runs in "
                  f"{fmt_s(time.time() - t_suite)})\n")

    # Merge the candidate into the results folder.
    verdict = compare_results.install(out, stage, accept=a.update_baseline, log=print)
    for suite_name, what, cmd, tail in failed:
        print(f"\nrun_suite.py: [{suite_name}] {what} failed:\n  {cmd}\n{tail}", file=sys.stderr)
    for rel, small, large in verdict["refused"]:
        how = "--extended --update-baseline" if large == "extended" else "--update-baseline without --quick"
        print(f"\nrun_suite.py: --update-baseline refused for {rel}: this {small} run differs from the committed "
              f"{large} summary, which would then describe results no longer in the folder; rerun that suite "
              f"with {how}", file=sys.stderr)
    refused = {rel for rel, _, _ in verdict["refused"]}
    for summ, files in verdict["stale"].items():
        if summ not in refused:
            print(f"\nrun_suite.py: --update-baseline did not write {len(files)} differing file(s) that {summ} lists "
                  f"(a partial run, --run, rewrites no summary): rerun that suite whole with --update-baseline "
                  f"(--extended where its summary is the extended one)", file=sys.stderr)
    kept = verdict["kept"]
    print(f"\nrun_suite.py: {total} runs in {fmt_s(time.time() - start)}; {len(failed)} failed; "
          f"{verdict['differ']} simulated file(s) differ from {rel_to(out, ROOT)}"
          + (f" ({verdict['differ'] - kept} written: --update-baseline)" if a.update_baseline and verdict["differ"] else "")
          + (f" ({kept} kept under {rel_to(stage, ROOT)}"
             + ("; rerun with --update-baseline to accept)" if not a.update_baseline else ")") if kept else ""))
    sys.exit(1 if failed or kept else 0)


if __name__ == "__main__":
    main()
