"""scripts/moelab_results.py — the result store: its file formats, read, checked and written.

One module for every script that reads or writes the store (scripts/run_suite.py,
scripts/compare_results.py, scripts/claims.py, plots/figures.py, plots/report.py). Standard
library only. The formats are documented in docs/RESULTS-SCHEMA.md:

  moelab.result/1         one run of `moelab run --out` (written by harness/cli/run.cpp)
  moelab.suite-summary/1  one suite run (written by scripts/run_suite.py)
  moelab.suite/2          an experiment suite, experiments/<name>/suite.json (hand-written data)

Every loader raises SchemaError with one message naming the file and the field:
    results/x.json: field "metrics.step_time_s.median": expected a number, got "fast"
Every writer is atomic (a temporary file in the destination folder, then a rename): an
interrupted run leaves the old file or the complete new one, never a truncated one.
"""
import glob
import json
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
RESULTS = os.path.join(ROOT, "results")

RESULT_SCHEMA = "moelab.result/1"
SUMMARY_SCHEMA = "moelab.suite-summary/1"
SUITE_SCHEMA = "moelab.suite/2"
BACKENDS = ("cpu", "cuda", "sim")


class SchemaError(ValueError):
    """A file that is not what it claims to be; the message names the file and the field."""


# ---- reading and writing --------------------------------------------------------------------

def load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SchemaError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SchemaError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise SchemaError(f"{path}: empty file")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        end = "" if text.rstrip().endswith(("}", "]")) else " (the file ends before the JSON does: truncated?)"
        raise SchemaError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}{end}") from None


def _atomic(path, write):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path, obj):
    """Writes obj as indented JSON to path atomically; creates the folder."""
    data = (json.dumps(obj, indent=2) + "\n").encode()
    _atomic(path, lambda f: f.write(data))


def write_text(path, text):
    _atomic(path, lambda f: f.write(text.encode()))


def pyplot(script):
    """matplotlib.pyplot with the Agg backend, or exit naming the script and how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(f"{script}: matplotlib is missing (Debian: apt-get install python3-matplotlib; or scripts/setup.sh)")
    return plt


def dtype_label(result):
    """The dtype a result ran in as the suites name it: "tf32" for fp32 tensors with TF32 GEMMs."""
    m = result["workload"]["model"]
    return "tf32" if m.get("dtype") == "fp32" and m.get("allow_tf32") else m.get("dtype", "?")


def save_figure(fig, path, dpi):
    """Saves a matplotlib figure as PNG atomically (a reader never sees half a PNG)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def copy_atomic(src, dst):
    with open(src, "rb") as s:
        _atomic(dst, lambda f: shutil.copyfileobj(s, f))


# ---- checking values ------------------------------------------------------------------------

def _kind(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return f'"{v[:40]}"'
    return "a list" if isinstance(v, list) else "an object"


class _Checker:
    """Reads fields of one file; every complaint names the file and the dotted field path."""

    def __init__(self, path):
        self.path = path

    def fail(self, field, msg):
        raise SchemaError(f'{self.path}: field "{field}": {msg}')

    def get(self, obj, key, where, required=True):
        field = f"{where}.{key}" if where else key
        if not isinstance(obj, dict):
            self.fail(where or "(top level)", f"expected an object, got {_kind(obj)}")
        if key not in obj:
            if required:
                self.fail(field, "missing")
            return field, None
        return field, obj[key]

    def number(self, obj, key, where="", required=True, minimum=None, null=False):
        field, v = self.get(obj, key, where, required)
        if v is None and (null or not required):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(field, f"expected a number, got {_kind(v)}")
        if minimum is not None and v < minimum:
            self.fail(field, f"expected a number >= {minimum}, got {v}")
        return v

    def integer(self, obj, key, where="", required=True, minimum=None):
        field, v = self.get(obj, key, where, required)
        if v is None and not required:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(field, f"expected an integer, got {_kind(v)}")
        if minimum is not None and v < minimum:
            self.fail(field, f"expected an integer >= {minimum}, got {v}")
        return v

    def string(self, obj, key, where="", required=True, null=False, choices=None):
        field, v = self.get(obj, key, where, required)
        if v is None and (null or not required):
            return v
        if not isinstance(v, str):
            self.fail(field, f"expected a string, got {_kind(v)}")
        if choices and v not in choices:
            self.fail(field, f'expected one of {", ".join(choices)}, got "{v}"')
        return v

    def boolean(self, obj, key, where="", required=True, null=False):
        field, v = self.get(obj, key, where, required)
        if v is None and (null or not required):
            return v
        if not isinstance(v, bool):
            self.fail(field, f"expected true or false, got {_kind(v)}")
        return v

    def obj(self, obj, key, where="", required=True, null=False):
        field, v = self.get(obj, key, where, required)
        if v is None and (null or not required):
            return v
        if not isinstance(v, dict):
            self.fail(field, f"expected an object, got {_kind(v)}")
        return v

    def array(self, obj, key, where="", required=True, nonempty=False):
        field, v = self.get(obj, key, where, required)
        if v is None and not required:
            return v
        if not isinstance(v, list):
            self.fail(field, f"expected a list, got {_kind(v)}")
        if nonempty and not v:
            self.fail(field, "expected a non-empty list")
        return v

    def numbers_map(self, obj, key, where="", integer=False, required=True):
        m = self.obj(obj, key, where, required)
        field = f"{where}.{key}" if where else key
        for k in (m or {}):
            (self.integer if integer else self.number)(m, k, field, minimum=0 if integer else None)
        return m

    def schema(self, obj, expected):
        if not isinstance(obj, dict):
            raise SchemaError(f"{self.path}: expected a JSON object at the top level, got {_kind(obj)}")
        v = self.string(obj, "schema")
        if v != expected:
            self.fail("schema", f'unknown schema "{v}" (expected "{expected}")')


# ---- moelab.result/1 ------------------------------------------------------------------------

DATE_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def check_result(res, path):
    """Raises SchemaError unless res is a well-formed moelab.result/1; returns res."""
    c = _Checker(path)
    c.schema(res, RESULT_SCHEMA)
    mode = c.string(res, "mode", choices=("measured", "simulated"))
    backend = c.string(res, "backend", choices=BACKENDS)
    if (backend == "sim") != (mode == "simulated"):
        c.fail("mode", f'"{mode}" does not go with backend "{backend}" (sim results are simulated, others measured)')
    c.string(res, "device")
    cluster = c.obj(res, "cluster", null=True)
    cal = c.string(res, "calibration", null=True)
    if mode == "simulated":
        if cluster is None:
            c.fail("cluster", "a simulated result needs its cluster model, got null")
        c.string(cluster, "name", "cluster")
        if cal is None:
            c.fail("calibration", "a simulated result needs its calibration profile's name, got null")
        c.string(res, "routing_model")
    elif cal is not None:
        c.fail("calibration", f'a measured result has no calibration profile, got "{cal}"')
    c.string(res, "commit")
    date = c.string(res, "date")
    if not DATE_RE.match(date):
        c.fail("date", f'expected UTC ISO 8601 like "2026-11-22T04:40:30Z", got "{date}"')
    world = c.integer(res, "world_size", minimum=1)
    if "workload" in res or "model" not in res:  # one MoE layer (moelab run --workload)
        wl = c.obj(res, "workload")
        c.string(wl, "name", "workload")
        c.integer(wl, "tokens_per_rank", "workload", minimum=1)
        model = c.obj(wl, "model", "workload")
        for k in ("d_model", "d_hidden", "num_experts", "top_k"):
            c.integer(model, k, "workload.model", minimum=1)
        c.string(model, "dtype", "workload.model")
    else:  # a whole model (moelab run --model)
        model = c.obj(res, "model")
        c.string(model, "name", "model")
        for k in ("d_model", "num_layers", "seq_len", "vocab_size"):
            c.integer(model, k, "model", minimum=1)
        c.string(model, "dtype", "model")
        tr = c.obj(res, "training")
        layers = c.array(tr, "layers", "training")
        if len(layers) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers) \
                or not 0 <= layers[0] < layers[1] <= model["num_layers"]:
            c.fail("training.layers", f"expected [first, last) within the model's {model['num_layers']} layers, "
                                      f"got {layers}")
        for k in ("micro_batch", "microbatches", "steps"):
            c.integer(tr, k, "training", minimum=1)
        c.string(tr, "optimizer", "training")
    par = c.obj(res, "parallel", required=False)
    if par is not None:
        _check_parallel(c, par, mode, world)
    c.string(res, "impl")
    c.obj(res, "impl_options", required=False)
    c.obj(res, "impl_report")
    m = c.obj(res, "metrics")
    st = c.obj(m, "step_time_s", "metrics")
    for k in ("median", "mean", "min", "max"):
        c.number(st, k, "metrics.step_time_s", minimum=0)
    for i, v in enumerate(c.array(st, "all", "metrics.step_time_s", nonempty=True)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            c.fail(f"metrics.step_time_s.all[{i}]", f"expected a number, got {_kind(v)}")
    for k in ("tokens_per_s", "comm_s", "compute_busy_s", "exposed_comm_s", "overlap_limit_s", "host_copy_s",
              "expert_tflops", "expert_gemm_tflops", "expert_gemm_s", "bare_gemm_s", "expert_vs_bare_ratio"):
        c.number(m, k, "metrics")
    c.number(m, "overlap_ratio", "metrics", minimum=0)
    c.string(m, "bare_gemm_library", "metrics")
    c.numbers_map(m, "phases_s", "metrics")
    c.numbers_map(m, "stream_busy_s", "metrics")
    pk = c.obj(m, "peak_memory_bytes", "metrics")
    c.integer(pk, "device_total", "metrics.peak_memory_bytes", minimum=0)
    c.integer(pk, "rank", "metrics.peak_memory_bytes", minimum=0)
    c.numbers_map(pk, "by_category_at_peak", "metrics.peak_memory_bytes", integer=True)
    c.numbers_map(pk, "peak_per_category", "metrics.peak_memory_bytes", integer=True)
    pool = c.obj(pk, "device_pool", "metrics.peak_memory_bytes", required=False)
    if pool is not None:
        for k in ("used_high", "reserved_high", "rank"):
            c.integer(pool, k, "metrics.peak_memory_bytes.device_pool", minimum=0)
    rt = c.obj(m, "routing", "metrics")
    c.integer(rt, "dropped", "metrics.routing", minimum=0)
    c.integer(rt, "capacity", "metrics.routing", minimum=0)
    c.array(rt, "recv_per_local_expert", "metrics.routing")
    return res


def load_result(path):
    return check_result(load_json(path), path)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def _link_bytes(c, obj, key, where, simulated):
    """Bytes per link class: an object of nvlink, pcie, nic on sim; null when measured."""
    lb = c.obj(obj, key, where, null=True)
    field = f"{where}.{key}" if where else key
    if simulated and lb is None:
        c.fail(field, "a simulated result counts the bytes per link class, got null")
    if not simulated and lb is not None:
        c.fail(field, "only the sim counts bytes per link class; a measured result has null")
    for k in ("nvlink", "pcie", "nic") if lb is not None else ():
        c.number(lb, k, field, minimum=0)


COLLECTIVES = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send_recv", "barrier")


def _link_bytes_by_collective(c, obj, where, simulated):
    """The same bytes split by collective: {collective: {nvlink, pcie, nic}} on sim; null measured."""
    by = c.obj(obj, "link_bytes_by_collective", where, null=True)
    field = f"{where}.link_bytes_by_collective"
    if simulated and by is None:
        c.fail(field, "a simulated result splits the link bytes by collective, got null")
    if not simulated and by is not None:
        c.fail(field, "only the sim counts bytes per link class; a measured result has null")
    for k in sorted(by) if by is not None else ():
        if k not in COLLECTIVES:
            c.fail(f"{field}.{k}", f"not a collective ({', '.join(COLLECTIVES)})")
        _link_bytes(c, by, k, field, simulated)


def _check_parallel(c, par, mode, world):
    """The "parallel" object of a --parallel model run (docs/RESULTS-SCHEMA.md)."""
    lay = c.obj(par, "layout", "parallel")
    sizes = {k: c.integer(lay, k, "parallel.layout", minimum=1) for k in ("world", "tp", "pp", "dp", "ep", "etp", "edp")}
    if sizes["world"] != world:
        c.fail("parallel.layout.world", f"{sizes['world']} is not world_size {world}")
    if sizes["tp"] * sizes["pp"] * sizes["dp"] != world:
        c.fail("parallel.layout", f"tp x pp x dp = {sizes['tp'] * sizes['pp'] * sizes['dp']} is not world_size {world}")
    c.string(par, "spec", "parallel")
    sch = c.obj(par, "schedule", "parallel")
    c.string(sch, "name", "parallel.schedule", choices=SCHEDULES)
    if c.integer(sch, "stages", "parallel.schedule", minimum=1) != sizes["pp"]:
        c.fail("parallel.schedule.stages", f"{sch['stages']} stages for pp = {sizes['pp']}")
    c.integer(sch, "microbatches", "parallel.schedule", minimum=1)
    c.integer(sch, "chunks", "parallel.schedule", minimum=1)
    c.string(sch, "placement", "parallel.schedule", choices=("interleaved", "vshape"))
    c.string(sch, "recompute", "parallel.schedule", choices=("none", "selective", "full"))
    if not 0 <= c.number(par, "bubble", "parallel") <= 1:
        c.fail("parallel.bubble", f"expected a ratio in [0, 1], got {par['bubble']}")
    c.number(par, "pipeline_window_s", "parallel", minimum=0)
    simulated = mode == "simulated"
    stages = c.array(par, "stages", "parallel", nonempty=True)
    if len(stages) != sizes["pp"]:
        c.fail("parallel.stages", f"{len(stages)} entries for pp = {sizes['pp']}")
    for i, st in enumerate(stages):
        w = f"parallel.stages[{i}]"
        if c.integer(st, "stage", w, minimum=0) != i:
            c.fail(f"{w}.stage", f"expected {i}, got {st['stage']}")
        c.array(st, "ranks", w, nonempty=True)
        for k in ("work_s", "span_s"):
            c.number(st, k, w, minimum=0)
        if not 0 <= c.number(st, "bubble", w) <= 1:
            c.fail(f"{w}.bubble", f"expected a ratio in [0, 1], got {st['bubble']}")
        for k in ("peak_activation_bytes", "peak_buffer_bytes", "peak_device_bytes"):
            c.integer(st, k, w, minimum=0)
        c.integer(st, "microbatches_in_flight", w, minimum=1)
        _link_bytes(c, st, "link_bytes", w, simulated)
        _link_bytes_by_collective(c, st, w, simulated)
    _link_bytes(c, par, "link_bytes", "parallel", simulated)
    _link_bytes_by_collective(c, par, "parallel", simulated)
    c.boolean(par, "sequence_parallel", "parallel")
    gs = c.obj(par, "gradient_sync", "parallel")
    c.string(gs, "kind", "parallel.gradient_sync", choices=("bucketed_all_reduce", "zero1"))
    c.integer(gs, "bucket_elems", "parallel.gradient_sync", minimum=1)


# ---- moelab.suite-summary/1 -----------------------------------------------------------------

def check_summary(s, path):
    """Raises SchemaError unless s is a well-formed moelab.suite-summary/1; returns s."""
    c = _Checker(path)
    c.schema(s, SUMMARY_SCHEMA)
    c.string(s, "suite")
    c.string(s, "subset", choices=("full", "quick"))
    c.string(s, "mode", choices=("measured", "simulated", "mixed", "none"))
    c.string(s, "commit", null=True)
    c.string(s, "date")
    for i, p in enumerate(c.array(s, "points")):
        w = f"points[{i}]"
        for k in ("cluster", "model", "dtype"):
            c.string(p, k, w)
        c.integer(p, "tokens_per_rank", w, minimum=1)
        for label, fig in c.obj(p, "results", w).items():
            c.number(fig, "step_time_s", f"{w}.results.{label}", minimum=0)
            c.integer(fig, "peak_memory_bytes", f"{w}.results.{label}", minimum=0)
        c.numbers_map(p, "speedup", w)
        c.numbers_map(p, "memory_saving", w)
    for i, r in enumerate(c.array(s, "runs", required=False) or []):
        w = f"runs[{i}]"
        for k in ("id", "impl", "workload", "backend"):
            c.string(r, k, w)
        if c.string(r, "skipped", w, required=False) is None:
            c.string(r, "mode", w, choices=("measured", "simulated"))
            c.string(r, "file", w)
            c.number(c.obj(r, "results", w), "step_time_s", f"{w}.results", minimum=0)
    for i, r in enumerate(c.array(s, "claims")):
        w = f"claims[{i}]"
        for k in ("id", "system", "versus", "text", "source", "verdict"):
            c.string(r, k, w)
        c.string(r, "metric", w, choices=("speedup", "memory_saving"))
        c.number(r, "paper", w)
        c.obj(r, "ours", w)
        c.boolean(r, "direction_agrees", w, null=True)
        c.boolean(r, "size_agrees", w, null=True)
    return s


def load_summary(path):
    return check_summary(load_json(path), path)


# ---- moelab.suite/2 -------------------------------------------------------------------------

def _names(c, items, field):
    names = [x for x in items]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        c.fail(field, f"duplicate names: {', '.join(dup)}")


def check_suite(s, path):
    """Raises SchemaError unless s is a well-formed moelab.suite/2; returns s.

    Checks every cross-reference (a sweep's clusters and models, a run's implementations,
    a claim's systems), so that a mistake in the data is named before anything runs."""
    c = _Checker(path)
    c.schema(s, SUITE_SCHEMA)
    name = c.string(s, "name")
    if not re.match(r"^[a-z0-9][a-z0-9_-]*$", name):
        c.fail("name", f'expected lower-case letters, digits, "-" and "_", got "{name}"')
    c.string(s, "description")
    out = c.string(s, "out")
    if os.path.isabs(out) or ".." in out.split("/"):
        c.fail("out", f'expected a folder inside the results folder, got "{out}"')
    impls = c.array(s, "impls", nonempty=True)
    for i, im in enumerate(impls):
        w = f"impls[{i}]"
        c.string(im, "label", w)
        c.string(im, "impl", w)
        c.obj(im, "options", w)
        c.string(im, "kind", w, choices=("baseline", "system"))
        if c.string(im, "requires_option", w, required=False):
            c.string(im, "skip_note", w)
    labels = [im["label"] for im in impls]
    _names(c, labels, "impls")

    def known_impls(lst, field):
        for j, lab in enumerate(lst):
            if lab not in labels:
                c.fail(f"{field}[{j}]", f'"{lab}" is not a label of the suite\'s "impls" ({", ".join(labels)})')

    grid = c.obj(s, "grid", required=False)
    models = []
    if grid is not None:
        wd = c.obj(grid, "workload_defaults", "grid")
        for k in ("num_experts", "top_k", "steps", "warmup", "seed"):
            c.integer(wd, k, "grid.workload_defaults", minimum=0)
        c.number(wd, "capacity_factor", "grid.workload_defaults", minimum=0)
        c.string(wd, "activation", "grid.workload_defaults")
        c.integer(wd, "expert_parallel", "grid.workload_defaults", minimum=0)
        for i, m in enumerate(c.array(grid, "models", "grid", nonempty=True)):
            c.string(m, "name", f"grid.models[{i}]")
            c.integer(m, "d_model", f"grid.models[{i}]", minimum=1)
            c.integer(m, "d_hidden", f"grid.models[{i}]", minimum=1)
        models = [m["name"] for m in grid["models"]]
        _names(c, models, "grid.models")
        clusters = c.array(grid, "clusters", "grid", nonempty=True)
        for i, cl in enumerate(clusters):
            c.string(cl, "name", f"grid.clusters[{i}]")
            c.integer(cl, "gpus", f"grid.clusters[{i}]", minimum=1)
        cnames = [cl["name"] for cl in clusters]
        _names(c, cnames, "grid.clusters")
        c.integer(grid, "global_tokens_as_gpus", "grid", required=False, minimum=1)
        known_impls(c.array(grid, "impls", "grid", nonempty=True), "grid.impls")
        for key in ("sweeps", "quick_sweeps"):
            sweeps = c.array(grid, key, "grid", nonempty=(key == "sweeps"), required=(key == "sweeps")) or []
            for i, sw in enumerate(sweeps):
                w = f"grid.{key}[{i}]"
                c.string(sw, "name", w)
                for j, cn in enumerate(c.array(sw, "clusters", w, nonempty=True)):
                    if cn not in cnames:
                        c.fail(f"{w}.clusters[{j}]", f'"{cn}" is not in grid.clusters ({", ".join(cnames)})')
                for j, mn in enumerate(c.array(sw, "models", w, nonempty=True)):
                    if mn not in models:
                        c.fail(f"{w}.models[{j}]", f'"{mn}" is not in grid.models ({", ".join(models)})')
                for j, dt in enumerate(c.array(sw, "dtypes", w, nonempty=True)):
                    if dt not in ("fp32", "tf32", "bf16"):
                        c.fail(f"{w}.dtypes[{j}]", f'expected fp32, tf32 (fp32 with TF32 GEMMs) or bf16, got {_kind(dt)}')
                for j, b in enumerate(c.array(sw, "tokens_per_gpu", w, nonempty=True)):
                    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                        c.fail(f"{w}.tokens_per_gpu[{j}]", f"expected a positive integer, got {_kind(b)}")

    runs = c.array(s, "runs", required=False) or []
    for i, r in enumerate(runs):
        w = f"runs[{i}]"
        c.string(r, "id", w)
        backend = c.string(r, "backend", w, choices=BACKENDS)
        for j, wl in enumerate(c.array(r, "workloads", w, nonempty=True)):
            if isinstance(wl, dict):
                if grid is None:
                    c.fail(f"{w}.workloads[{j}]", "a generated workload (an object) needs the suite's \"grid\"")
                mn = c.string(wl, "model", f"{w}.workloads[{j}]")
                if mn not in models:
                    c.fail(f"{w}.workloads[{j}].model", f'"{mn}" is not in grid.models ({", ".join(models)})')
                c.string(wl, "dtype", f"{w}.workloads[{j}]")
                c.integer(wl, "tokens_per_rank", f"{w}.workloads[{j}]", minimum=1)
            elif not isinstance(wl, str):
                c.fail(f"{w}.workloads[{j}]", f"expected a workload name, a path or an object, got {_kind(wl)}")
        known_impls(c.array(r, "impls", w, nonempty=True), f"{w}.impls")
        if backend == "sim":
            c.array(r, "clusters", w, nonempty=True)
        elif "clusters" in r:
            c.fail(f"{w}.clusters", f'only sim runs have clusters, this one runs on "{backend}"')
        for j, n in enumerate(c.array(r, "ranks", w, required=(backend != "sim"), nonempty=True) or []):
            if n != "hostfile" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                c.fail(f"{w}.ranks[{j}]", f'expected a positive integer or "hostfile", got {_kind(n)}')
        c.integer(r, "steps", w, required=False, minimum=1)
        c.boolean(r, "trace", w, required=False)
        path_t = c.string(r, "path", w)
        if os.path.isabs(path_t) or ".." in path_t.split("/") or path_t.endswith(".json"):
            c.fail(f"{w}.path", f'expected a path inside the results folder without ".json", got "{path_t}"')
        q = r.get("quick", False)
        if not isinstance(q, (bool, dict)):
            c.fail(f"{w}.quick", f"expected true, false or an object of fields to override, got {_kind(q)}")
    _names(c, [r["id"] for r in runs], "runs")
    if grid is None and not runs:
        c.fail("grid", 'a suite needs a "grid", "runs", or both')

    claims = c.obj(s, "claims", required=False)
    if claims is not None:
        c.number(claims, "size_tolerance", "claims", minimum=0)
        c.obj(claims, "paper_setup", "claims", required=False)
        for i, it in enumerate(c.array(claims, "items", "claims", nonempty=True)):
            w = f"claims.items[{i}]"
            for k in ("id", "text", "source"):
                c.string(it, k, w)
            for k in ("system", "versus"):
                lab = c.string(it, k, w)
                if lab not in labels:
                    c.fail(f"{w}.{k}", f'"{lab}" is not a label of the suite\'s "impls"')
            c.string(it, "metric", w, choices=("speedup", "memory_saving"))
            c.string(it, "stat", w, choices=("max", "mean"))
            c.number(it, "paper", w)
        _names(c, [it["id"] for it in claims["items"]], "claims.items")

    for i, fg in enumerate(c.array(s, "figures", required=False) or []):
        w = f"figures[{i}]"
        c.string(fg, "id", w)
        c.string(fg, "script", w)
        c.array(fg, "args", w)
        c.array(fg, "files", w, nonempty=True)
        c.string(fg, "caption", w)
        c.string(fg, "mode", w, choices=("measured", "simulated", "mixed"))
        c.boolean(fg, "headline", w, required=False)
    return s


def suite_path(name_or_path, experiments=EXPERIMENTS):
    """A suite's file: a path (contains "/" or ends in .json) or a name in experiments/<name>/."""
    if "/" in name_or_path or name_or_path.endswith(".json"):
        return name_or_path
    return os.path.join(experiments, name_or_path, "suite.json")


def registered_suites(experiments=EXPERIMENTS):
    """Every experiments/*/suite.json, in name order: the registered suites."""
    return sorted(glob.glob(os.path.join(experiments, "*", "suite.json")))


def load_suite(name_or_path, experiments=EXPERIMENTS):
    path = suite_path(name_or_path, experiments)
    if not os.path.exists(path):
        known = [os.path.basename(os.path.dirname(p)) for p in registered_suites(experiments)]
        raise SchemaError(f"{path}: no such suite (registered: {', '.join(known) or 'none'})")
    s = check_suite(load_json(path), path)
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if os.path.basename(path) == "suite.json" and folder != s["name"]:
        raise SchemaError(f'{path}: field "name": "{s["name"]}" must be the folder\'s name, "{folder}"')
    s["_path"] = path
    return s


def summary_path(suite, results):
    return os.path.join(results, suite["out"], "summary.json")


# ---- claims, as tables print them ----------------------------------------------------------

def fmt_claim(metric, v):
    return f"{v:.2f}x" if metric == "speedup" else f"{100 * v:.0f}%"


def claim_rows(summary):
    """One dict of display strings per claim of a summary: what both tables show."""
    rows = []
    for c in summary.get("claims", []):
        scope = c.get("compared_on", "all_points")
        o = c["ours"].get(scope, {"points": 0})
        setup = c.get("paper_setup") or {}
        on = ("the paper's setup" + (" (" + ", ".join(str(v) for v in setup.values()) + ")" if setup else "")
              if scope == "paper_setup" else "every point of the run")
        yn = {True: "yes", False: "no", None: "-"}
        rows.append({"suite": summary["suite"], "id": c["id"], "claim": c["text"], "source": c["source"],
                     "paper": fmt_claim(c["metric"], c["paper"]),
                     "ours": fmt_claim(c["metric"], o["value"]) if o.get("points") else "not run",
                     "points": str(o.get("points", 0)), "on": on, "mode": c.get("mode", summary.get("mode")),
                     "direction": yn[c["direction_agrees"]], "size": yn[c["size_agrees"]], "verdict": c["verdict"]})
    return rows


# ---- classifying files of a result tree -----------------------------------------------------

def classify(obj):
    """What a parsed JSON file of a result tree is: result, summary, bench, trace or other."""
    if isinstance(obj, dict):
        sch = obj.get("schema")
        if sch == RESULT_SCHEMA or (isinstance(sch, str) and sch.startswith("moelab.result/")):
            return "result"
        if sch == SUMMARY_SCHEMA or (isinstance(sch, str) and sch.startswith("moelab.suite-summary/")):
            return "summary"
        if "benchmarks" in obj and "context" in obj:
            return "bench"
        if "traceEvents" in obj:
            return "trace"
    elif isinstance(obj, list):
        return "trace"
    return "other"


def device_class(device):
    """The device without its memory note: "NVIDIA H100 80GB HBM3 (79.1 GiB)" -> "NVIDIA H100 80GB HBM3"."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", device or "").strip()


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"
