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
import math
import os
import re
import shutil
import string
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
        doc = json.loads(text, parse_constant=_NonFinite)
    except json.JSONDecodeError as e:
        end = "" if text.rstrip().endswith(("}", "]")) else " (the file ends before the JSON does: truncated?)"
        raise SchemaError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}{end}") from None
    except RecursionError:
        raise SchemaError(f"{path}: JSON nested too deeply to read") from None
    bad = _not_json(doc)
    if bad is not None:
        field, what = bad
        raise SchemaError(f"{path}: field {_field(field or '(top level)')}: {what}")
    return doc


class _NonFinite:
    """NaN, Infinity or -Infinity as Python's json module reads them (they are not JSON: RFC 8259,
    section 6), kept as a marker so that the error names the field."""

    def __init__(self, name):
        self.name = name


_SURROGATE = re.compile("[\ud800-\udfff]")


def _not_json(doc):
    """(dotted field, what is wrong) of the first value that Python's json module reads but JSON
    text does not hold: NaN or infinity, or a string or key with an unpaired UTF-16 surrogate
    ("\\ud800": no Unicode text; it cannot be printed as UTF-8 or passed on a command line).
    None when there is none. Iterative: a file deep enough to parse is not too deep to search."""
    stack = [(doc, "")]
    while stack:
        v, w = stack.pop()
        if isinstance(v, _NonFinite):
            return w, f"{v.name} is not a JSON number (JSON has no NaN or infinity)"
        if isinstance(v, str) and _SURROGATE.search(v):
            return w, "a string with an unpaired surrogate (\\ud800-\\udfff escapes): not Unicode text"
        if isinstance(v, dict):
            for k in v:
                if _SURROGATE.search(k):
                    return w, "a key with an unpaired surrogate (\\ud800-\\udfff escapes): not Unicode text"
            stack += [(x, f"{w}.{k}" if w else k) for k, x in reversed(list(v.items()))]
        elif isinstance(v, list):
            stack += [(x, f"{w}[{i}]") for i, x in reversed(list(enumerate(v)))]
    return None


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
    """A value of the file as an error message shows it: one short line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        t = str(v)
        return f"the number {t if len(t) <= 24 else t[:21] + '...'}"
    if isinstance(v, str):
        return json.dumps(v[:80]) + ("..." if len(v) > 80 else "")  # quotes, escapes line breaks
    return "a list" if isinstance(v, list) else "an object"


def _field(path):
    """A dotted field path in a message: quoted, and a key holding a line break stays on the one line."""
    f = json.dumps(path)
    return f if len(f) <= 120 else f[:117] + '..."'


def show(v):
    """A value of a file as a message shows it (quoted, escaped, cut to one short line)."""
    return _kind(v)


def field_error(path, field, msg):
    """The SchemaError of a check made outside this module (scripts/run_suite.py): file, field, what."""
    return SchemaError(f"{path}: field {_field(field)}: {msg}")


def _is_label(v):
    return bool(v) and not any(ord(ch) < 32 or ord(ch) == 127 for ch in v)


_NAME_RULE = 'expected a name usable in a file name (not empty, no "/" or control characters, not "." or "..")'


def _is_name(v):
    return bool(v) and "/" not in v and v not in (".", "..") and not any(ord(ch) < 32 for ch in v)


ABSENT = object()  # an optional field that a file leaves out


class _Checker:
    """Reads fields of one file; every complaint names the file and the dotted field path."""

    def __init__(self, path):
        self.path = path

    def fail(self, field, msg):
        raise SchemaError(f"{self.path}: field {_field(field)}: {msg}")

    def get(self, obj, key, where, required=True):
        """(dotted field, value); the value is ABSENT for an optional field that is not there.
        An optional field that is there is checked like a required one: null only where the
        caller allows null (a reader's .get(key, default) would see None, not the default)."""
        field = f"{where}.{key}" if where else key
        if not isinstance(obj, dict):
            self.fail(where or "(top level)", f"expected an object, got {_kind(obj)}")
        if key not in obj:
            if required:
                self.fail(field, "missing")
            return field, ABSENT
        return field, obj[key]

    def number(self, obj, key, where="", required=True, minimum=None, null=False, positive=False):
        field, v = self.get(obj, key, where, required)
        if v is ABSENT or (v is None and null):
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.fail(field, f"expected a number, got {_kind(v)}")
        if minimum is not None and v < minimum:
            self.fail(field, f"expected a number >= {minimum}, got {v}")
        if positive and v <= 0:
            self.fail(field, f"expected a number > 0, got {v}")
        return v

    def integer(self, obj, key, where="", required=True, minimum=None):
        field, v = self.get(obj, key, where, required)
        if v is ABSENT:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(field, f"expected an integer, got {_kind(v)}")
        if minimum is not None and v < minimum:
            self.fail(field, f"expected an integer >= {minimum}, got {_kind(v)}")
        return v

    def string(self, obj, key, where="", required=True, null=False, choices=None):
        field, v = self.get(obj, key, where, required)
        if v is ABSENT or (v is None and null):
            return None
        if not isinstance(v, str):
            self.fail(field, f"expected a string, got {_kind(v)}")
        if choices and v not in choices:
            self.fail(field, f'expected one of {", ".join(choices)}, got {_kind(v)}')
        return v

    def label(self, obj, key, where="", required=True):
        """A string a table or a message prints (an id): not empty, no line break or control character."""
        v = self.string(obj, key, where, required)
        if v is not None and not _is_label(v):
            self.fail(f"{where}.{key}" if where else key,
                      f"expected a non-empty label without line breaks or control characters, got {_kind(v)}")
        return v

    def name(self, obj, key, where="", required=True):
        """A string that becomes one component of a file path (a label, a model or a cluster)."""
        v = self.string(obj, key, where, required)
        if v is not None and not _is_name(v):
            self.fail(f"{where}.{key}" if where else key, f"{_NAME_RULE}, got {_kind(v)}")
        return v

    def boolean(self, obj, key, where="", required=True, null=False):
        field, v = self.get(obj, key, where, required)
        if v is ABSENT or (v is None and null):
            return None
        if not isinstance(v, bool):
            self.fail(field, f"expected true or false, got {_kind(v)}")
        return v

    def obj(self, obj, key, where="", required=True, null=False):
        field, v = self.get(obj, key, where, required)
        if v is ABSENT or (v is None and null):
            return None
        if not isinstance(v, dict):
            self.fail(field, f"expected an object, got {_kind(v)}")
        return v

    def array(self, obj, key, where="", required=True, nonempty=False):
        field, v = self.get(obj, key, where, required)
        if v is ABSENT:
            return None
        if not isinstance(v, list):
            self.fail(field, f"expected a list, got {_kind(v)}")
        if nonempty and not v:
            self.fail(field, "expected a non-empty list")
        return v

    def strings(self, obj, key, where="", required=True, nonempty=False, names=False):
        """A list of strings (of names, with names=True); returns it."""
        lst = self.array(obj, key, where, required, nonempty)
        field = f"{where}.{key}" if where else key
        for i, v in enumerate(lst or []):
            if not isinstance(v, str):
                self.fail(f"{field}[{i}]", f"expected a string, got {_kind(v)}")
            if names and not _is_name(v):
                self.fail(f"{field}[{i}]", f"{_NAME_RULE}, got {_kind(v)}")
        return lst

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
            self.fail("schema", f'unknown schema {_kind(v)} (expected "{expected}")')


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
        c.fail("calibration", f"a measured result has no calibration profile, got {_kind(cal)}")
    c.string(res, "commit")
    date = c.string(res, "date")
    if not DATE_RE.match(date):
        c.fail("date", f'expected UTC ISO 8601 like "2026-11-22T04:40:30Z", got {_kind(date)}')
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
    # The GEMM floor and the ratios to it: absent in results made before they were recorded;
    # the ratios null where no expert had a row.
    for k in ("floor_gemm_s", "moe_layer_s"):
        c.number(m, k, "metrics", required=False, minimum=0)
    c.string(m, "floor_gemm_library", "metrics", required=False)
    # cuda: the GEMM-path table the run chose by; cuda and a sim that prices the paths: the
    # calls per op name and path.
    c.string(m, "gemm_path_table", "metrics", required=False)
    c.string(m, "gemm_path_forced", "metrics", required=False, choices=GEMM_PATHS)  # moelab run --gemm-path
    taken = m.get("gemm_paths_taken")
    if taken is not None:
        if not isinstance(taken, dict):
            c.fail("metrics.gemm_paths_taken", f"expected an object {{op: {{path: calls}}}}, got {_kind(taken)}")
        for op, paths in taken.items():
            if not isinstance(paths, dict) or not all(
                    p in ("loop", "strided_batched", "grouped") and isinstance(n, int) and not isinstance(n, bool) and n > 0
                    for p, n in paths.items()):
                c.fail(f"metrics.gemm_paths_taken.{op}",
                       "expected {path: calls} with paths loop, strided_batched, grouped and calls > 0")
    # cuda: what the timed steps asked of the pinned host pool, and of the driver.
    if "host_pool" in m:
        hp = c.obj(m, "host_pool", "metrics")
        for k in ("timed_requests", "timed_driver_allocations", "timed_driver_releases", "peak_bytes_held"):
            c.integer(hp, k, "metrics.host_pool", minimum=0)
    for k in ("expert_vs_floor_ratio", "layer_vs_floor_ratio"):
        c.number(m, k, "metrics", required=False, minimum=0, null=True)
    c.numbers_map(m, "phases_s", "metrics")
    c.numbers_map(m, "stream_busy_s", "metrics")
    pk = c.obj(m, "peak_memory_bytes", "metrics")
    c.integer(pk, "device_total", "metrics.peak_memory_bytes", minimum=0)
    c.integer(pk, "rank", "metrics.peak_memory_bytes", minimum=0)
    c.numbers_map(pk, "by_category_at_peak", "metrics.peak_memory_bytes", integer=True)
    c.numbers_map(pk, "peak_per_category", "metrics.peak_memory_bytes", integer=True)
    opt = c.obj(pk, "optimizer_state", "metrics.peak_memory_bytes", required=False)
    if opt is not None:  # the peak with and without the optimizer's state (run_suite.py figures)
        for k in ("with", "without"):
            c.number(opt, k, "metrics.peak_memory_bytes.optimizer_state", minimum=0)
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


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "group-interleaved")


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
    if "group" in sch:
        c.integer(sch, "group", "parallel.schedule", minimum=0)
    if "offload" in par:  # PipeOffload's transfers (docs/RESULTS-SCHEMA.md)
        off = c.obj(par, "offload", "parallel")
        if c.integer(off, "chunks", "parallel.offload", minimum=1) > sch["chunks"]:
            c.fail("parallel.offload.chunks", f"{off['chunks']} of {sch['chunks']} chunks")
        for k in ("saved_bytes_per_layer", "compute_per_layer_s"):
            c.number(off, k, "parallel.offload", minimum=0)
        for k in ("k", "k_paper"):
            if off.get(k) is not None:
                c.number(off, k, "parallel.offload", minimum=0)
        offs = c.array(off, "stages", "parallel.offload", nonempty=True)
        for i, st in enumerate(offs):
            w = f"parallel.offload.stages[{i}]"
            for k in ("planned", "kept", "skipped_gap", "skipped_peak", "bytes_per_step", "peak_host_bytes"):
                c.integer(st, k, w, minimum=0)
            if st["kept"] + st["skipped_gap"] + st["skipped_peak"] != st["planned"]:
                c.fail(w, "kept + skipped is not planned")
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
    """Raises SchemaError unless s is a well-formed moelab.suite-summary/1; returns s.

    Checks every field that a reader of summaries uses (scripts/compare_results.py,
    scripts/claims.py, plots/report.py and the plot scripts), so that a summary it accepts is
    one they can all read."""
    c = _Checker(path)
    c.schema(s, SUMMARY_SCHEMA)
    c.string(s, "suite")
    c.string(s, "suite_file", required=False, null=True)
    c.string(s, "subset", choices=SUBSETS)
    c.string(s, "mode", choices=("measured", "simulated", "mixed", "none"))
    for k in ("calibration", "routing_model"):
        c.string(s, k, required=False, null=True)
    c.string(s, "commit", null=True)
    c.string(s, "date")
    c.number(s, "host_seconds", required=False, minimum=0)
    for i, sk in enumerate(c.array(s, "skipped", required=False) or []):
        w = f"skipped[{i}]"
        if c.string(sk, "impl", w, required=False) is None:
            c.string(sk, "run", w)
        c.string(sk, "reason", w)
        c.integer(sk, "count", w, required=False, minimum=0)
    for i, p in enumerate(c.array(s, "points")):
        w = f"points[{i}]"
        for k in ("cluster", "model", "dtype"):
            c.string(p, k, w)
        for k in ("tokens_per_rank", "tokens_per_gpu", "gpus"):
            c.integer(p, k, w, minimum=1)
        c.strings(p, "skipped", w, required=False)
        for label, fig in c.obj(p, "results", w).items():
            _check_figures(c, fig, f"{w}.results.{label}", full=False)
        c.numbers_map(p, "speedup", w)
        c.numbers_map(p, "memory_saving", w)
        c.numbers_map(p, "memory_saving_with_optimizer", w, required=False)
        for k in ("out_of_memory", "failed"):
            for label in c.obj(p, k, w, required=False) or {}:
                c.string(p[k], label, f"{w}.{k}")
    for i, r in enumerate(c.array(s, "runs", required=False) or []):
        w = f"runs[{i}]"
        for k in ("id", "impl", "workload"):
            c.string(r, k, w)
        c.string(r, "backend", w, choices=BACKENDS)
        cluster = c.string(r, "cluster", w, required=False, null=True)
        _, n = c.get(r, "ranks", w, required=False)
        if n is not ABSENT and n is not None and n != "hostfile" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            c.fail(f"{w}.ranks", f'expected a positive integer, "hostfile" or null, got {_kind(n)}')
        if c.string(r, "skipped", w, required=False) is None:
            mode = c.string(r, "mode", w, choices=("measured", "simulated"))
            c.string(r, "file", w)
            c.string(r, "device", w, required=(mode == "measured"))
            c.string(r, "calibration", w, required=False, null=True)
            c.integer(r, "world_size", w, minimum=1)
            if mode == "simulated" and cluster is None:
                c.fail(f"{w}.cluster", "a simulated run needs its cluster model, got null")
            _check_figures(c, c.obj(r, "results", w), f"{w}.results", full=True)
        if c.string(r, "run_mode", w, required=False, choices=RUN_MODES) is not None:
            # a whole-model run (a suite run with "models"): what the claims on runs pair it by
            for k in ("model", "model_file", "label"):
                c.string(r, k, w)
            lay = c.string(r, "layers", w, null=True)
            if lay is not None and layers_of(lay) is None:
                c.fail(f"{w}.layers", f'expected "A:B" or null, got {_kind(lay)}')
            c.string(r, "parallel", w, required=False, null=True)
            c.obj(r, "override", w, required=False, null=True)
            c.integer(r, "micro_batch", w, required=False, minimum=1)
            _check_pipeline(c, r, w)
    for i, r in enumerate(c.array(s, "claims")):
        w = f"claims[{i}]"
        for k in ("id", "text", "source", "verdict"):
            c.string(r, k, w)
        on_runs = c.string(r, "compared_on", w, required=False, choices=("paper_setup", "all_points", "runs")) == "runs"
        if on_runs:  # a claim on whole-model runs: one label or several; no baseline for one system's figure
            _, sy = c.get(r, "system", w)
            if not (isinstance(sy, str) or (isinstance(sy, list) and sy and all(isinstance(x, str) for x in sy))):
                c.fail(f"{w}.system", f"expected a run label or a list of them, got {_kind(sy)}")
            c.string(r, "versus", w, required=False, null=True)
            c.string(r, "metric", w, choices=RUN_METRICS)
            _check_select(c, r, w)
            rng = c.array(r, "paper_range", w, required=False)
            if rng is not None and (len(rng) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                             for v in rng)):
                c.fail(f"{w}.paper_range", f"expected [low, high], got {_kind(rng)}")
        else:
            for k in ("system", "versus"):
                c.string(r, k, w)
            c.string(r, "metric", w, choices=PAIR_METRICS)
        c.number(r, "paper", w)
        c.string(r, "mode", w, required=False)
        c.obj(r, "paper_setup", w, required=False, null=True)
        ours = c.obj(r, "ours", w)
        for scope in ("runs",) if on_runs else ("paper_setup", "all_points"):
            o = c.obj(ours, scope, f"{w}.ours", required=(r.get("compared_on", "all_points") == scope))
            if o is not None and c.integer(o, "points", f"{w}.ours.{scope}", minimum=0):
                c.number(o, "value", f"{w}.ours.{scope}")
                if scope == "runs":
                    c.strings(o, "used", f"{w}.ours.runs")
            if o is not None and scope == "runs":
                c.strings(o, "missing", f"{w}.ours.runs", required=False)
        c.boolean(r, "direction_agrees", w, null=True)
        c.boolean(r, "size_agrees", w, null=True)
        # what the report prints of a grid claim against the as-published baseline and of the
        # other way of counting memory (claim_rows)
        pub = c.obj(r, "as_published", w, required=False)
        if pub is not None:
            c.string(pub, "versus", f"{w}.as_published")
            c.string(pub, "verdict", f"{w}.as_published")
            _check_ours(c, pub, f"{w}.as_published", pub.get("compared_on", r.get("compared_on", "all_points")))
        oc = c.obj(r, "other_counting", w, required=False)
        if oc is not None:
            c.string(oc, "memory_counts", f"{w}.other_counting", choices=("tracked", "with_optimizer_state"))
            c.string(oc, "verdict", f"{w}.other_counting")
            _check_ours(c, oc, f"{w}.other_counting", r.get("compared_on", "all_points"))
    return s


def _check_ours(c, row, where, scope):
    """A claim part's "ours" object: the scope it was compared on, with its points and value."""
    ours = c.obj(row, "ours", where)
    o = c.obj(ours, scope, f"{where}.ours")
    if c.integer(o, "points", f"{where}.ours.{scope}", minimum=0):
        c.number(o, "value", f"{where}.ours.{scope}")


def _check_figures(c, fig, where, full):
    """The figures of one run in a summary (scripts/run_suite.py figures()): the report prints
    these; full: a run's (its table shows overlap and exposed communication, plots/runs.py its
    phases)."""
    c.number(fig, "step_time_s", where, minimum=0)
    c.integer(fig, "peak_memory_bytes", where, minimum=0)
    c.string(fig, "file", where, required=False)
    _, n = c.get(fig, "partitions", where, required=False)
    if n is not ABSENT and n is not None and n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        c.fail(f"{where}.partitions", f'expected a positive integer or "auto", got {_kind(n)}')
    for k in ("overlap_ratio", "exposed_comm_s"):
        c.number(fig, k, where, required=full, minimum=0)
    for k in ("all_to_all_share", "all_to_all_overlap"):  # whole-model runs (run_suite.py model_figures)
        c.number(fig, k, where, required=False, minimum=0)
    for k in ("comm_s", "compute_busy_s"):  # the report's comm/comp and overlap bound per grid point
        c.number(fig, k, where, required=False, minimum=0)
    c.numbers_map(fig, "phases_s", where, required=full)  # plots/runs.py stacks them
    c.string(fig, "gemm_path_forced", where, required=False, choices=GEMM_PATHS)  # moelab run --gemm-path


def load_summary(path):
    return check_summary(load_json(path), path)


# ---- moelab.suite/2 -------------------------------------------------------------------------

def _names(c, items, field):
    names = [x for x in items]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        c.fail(field, f"duplicate names: {', '.join(_kind(x) for x in dup)}")


# What a run's "path" may name (scripts/run_suite.py destination()).
PATH_FIELDS = ("workload", "impl", "ranks", "cluster", "backend", "device", "model", "label", "run_mode")
DTYPES = ("fp32", "tf32", "bf16")
# A suite run's subsets, smallest first: "quick" (each suite's reduced subset), "full" (the
# default: every sweep but the extended ones), "extended" (every sweep). A smaller subset's
# summary is compared with a larger one's on the points they share and never replaces it.
SUBSETS = ("quick", "full", "extended")
RUN_MODES = ("training", "inference")
LAYERS_RE = re.compile(r"^(\d{1,6}):(\d{1,6})$")


def _check_path_template(c, field, path_t):
    if os.path.isabs(path_t) or ".." in path_t.split("/") or path_t.endswith(".json") or not path_t.strip("/"):
        c.fail(field, f'expected a path inside the results folder without ".json", got {_kind(path_t)}')
    try:
        parts = list(string.Formatter().parse(path_t))
    except ValueError as e:
        c.fail(field, f"{e} in {_kind(path_t)} (a literal brace is written {{{{ or }}}})")
    for _, name, spec, conv in parts:
        if name is None:
            continue
        if name not in PATH_FIELDS or spec or conv:
            c.fail(field, f"{_kind('{' + name + ('!' + conv if conv else '') + (':' + spec if spec else '') + '}')} "
                          f"is not one of {', '.join('{' + f + '}' for f in PATH_FIELDS)}")


def layers_of(spec):
    """(first, last) of a "layers" field "A:B" (moelab run --layers A:B: layers [A, B)), or None."""
    m = LAYERS_RE.match(spec) if isinstance(spec, str) else None
    return (int(m.group(1)), int(m.group(2))) if m and int(m.group(1)) < int(m.group(2)) else None


def model_entry(spec):
    """A run's "models" entry as an object: a model file's name is {"file": name}; "model" (the
    name runs are compared by, e.g. the top-2 baseline's file for a ScMoE file) defaults to it."""
    e = {"file": spec} if isinstance(spec, str) else dict(spec)
    e.setdefault("model", e["file"])
    return e


def run_modes(r):
    """The "mode" of a run entry as a list (training and/or inference; default training)."""
    m = r.get("mode", "training")
    return [m] if isinstance(m, str) else list(m)


def run_labels(r):
    """The labels a run entry's results are known by: its "label", else each implementation's."""
    return [r["label"]] if r.get("label") else list(r["impls"])


def _check_models(c, r, w):
    """A run's "models": whole-model runs (moelab run --model) instead of "workloads"."""
    for j, spec in enumerate(c.array(r, "models", w, nonempty=True)):
        f = f"{w}.models[{j}]"
        if isinstance(spec, str):
            if not _is_name(spec):
                c.fail(f, f"expected a model file's name (experiments/models/NAME.json) or an object, got {_kind(spec)}")
            continue
        if not isinstance(spec, dict):
            c.fail(f, f"expected a model file's name or an object, got {_kind(spec)}")
        c.name(spec, "file", f)
        c.name(spec, "model", f, required=False)
        c.obj(spec, "override", f, required=False)
        c.integer(spec, "micro_batch", f, required=False, minimum=1)
        c.boolean(spec, "sequence_parallel", f, required=False)
        _check_pipeline(c, spec, f)
        if c.integer(spec, "ranks", f, required=False, minimum=1) is not None and r.get("backend") != "sim":
            c.fail(f"{f}.ranks", "a model entry's ranks (the first N GPUs of the cluster) are a sim run's")
        lay = c.string(spec, "layers", f, required=False)
        if lay is not None and layers_of(lay) is None:
            c.fail(f"{f}.layers", f'expected "A:B" with A < B (moelab run --layers), got {_kind(lay)}')
        par = c.obj(spec, "parallel", f, required=False)
        if par and lay is not None:
            c.fail(f"{f}.parallel", 'moelab run takes "layers" or "parallel", not both (the pipeline assigns the '
                                    'layers to its stages): cut the model with "override": {"num_layers": N} instead')
        for cl in par or {}:
            if not _is_name(cl):
                c.fail(f"{f}.parallel", f"expected cluster names as keys, got {_kind(cl)}")
            c.label(par, cl, f"{f}.parallel")


# A run's or a model entry's "pipeline": moelab run's pipeline flags (harness/cli/run.cpp), the
# model entry's keys over the run's. Value checks beyond the type are moelab's (exit code 2).
PIPELINE_FLAGS = {"schedule": "--schedule", "chunks": "--chunks", "group": "--group",
                  "microbatches": "--microbatches", "offload_chunks": "--offload-chunks",
                  "offload_all_lifespans": "--offload-all-lifespans", "pad_layers": "--pad-layers",
                  "recompute": "--recompute"}


def _check_pipeline(c, obj, w):
    pl = c.obj(obj, "pipeline", w, required=False)
    if pl is None:
        return
    f = f"{w}.pipeline"
    for k in pl:
        if k not in PIPELINE_FLAGS:
            c.fail(f"{f}.{k}", f"not a pipeline flag ({', '.join(PIPELINE_FLAGS)})")
    c.string(pl, "schedule", f, required=False)
    c.string(pl, "recompute", f, required=False, choices=("none", "selective", "full"))
    for k in ("chunks", "group", "microbatches"):
        c.integer(pl, k, f, required=False, minimum=1)
    for k in ("offload_all_lifespans", "pad_layers"):
        c.boolean(pl, k, f, required=False)
    _, k = c.get(pl, "offload_chunks", f, required=False)
    if k is not ABSENT and k != "all" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        c.fail(f"{f}.offload_chunks", f'expected a chunk count or "all", got {_kind(k)}')


def pipeline_of(run, entry):
    """The pipeline flags of one model entry of a run: the run's "pipeline" with the entry's over
    it; None when neither gives any."""
    pl = {**(run.get("pipeline") or {}), **(entry.get("pipeline") or {})}
    return pl or None


def pipeline_flags(pl):
    """moelab run's command-line flags for a "pipeline" object (PIPELINE_FLAGS order)."""
    out = []
    for k, flag in PIPELINE_FLAGS.items():
        v = (pl or {}).get(k)
        if v is None or v is False:
            continue
        out += [flag] if v is True else [flag, str(v)]
    return out


def pipeline_figures(res):
    """What a pipelined model run's summary row adds (docs/RESULTS-SCHEMA.md): the highest
    stage's peak activation bytes, every stage's, the closed form's peak in units of M_a
    (docs/pipeline-memory.md) per stage, the bubble, and PipeOffload's offload figures."""
    par = res.get("parallel") or {}
    st = par.get("stages") or []
    out = {}
    if st:
        out["peak_activation_bytes"] = max(x["peak_activation_bytes"] for x in st)
        out["stage_peak_activation_bytes"] = [x["peak_activation_bytes"] for x in st]
        out["stage_peak_device_bytes"] = [x["peak_device_bytes"] for x in st]
        if all(x.get("expected_peak_activation_ma") is not None for x in st):
            out["stage_expected_peak_activation_ma"] = [x["expected_peak_activation_ma"] for x in st]
    if par.get("bubble") is not None:
        out["bubble"] = par["bubble"]
    off = par.get("offload")
    if isinstance(off, dict):
        out["offload"] = {k: off[k] for k in ("chunks", "k", "k_paper", "saved_bytes_per_layer",
                                              "predicted_overhead") if k in off}
        out["offload"]["stage_bytes_per_step"] = [x.get("bytes_per_step", 0) for x in off.get("stages", [])]
        out["offload"]["stage_peak_host_bytes"] = [x.get("peak_host_bytes", 0) for x in off.get("stages", [])]
        # the (microbatch, chunk) offloads asked for and those the gap and lifespan rules kept
        out["offload"]["planned"] = sum(x.get("planned", 0) for x in off.get("stages", []))
        out["offload"]["kept"] = sum(x.get("kept", 0) for x in off.get("stages", []))
    tps = (res.get("metrics") or {}).get("tokens_per_s")
    if isinstance(tps, dict):
        tps = tps.get("median")
    if isinstance(tps, (int, float)):
        out["tokens_per_s"] = tps
    return out


GEMM_PATHS = ("loop", "strided_batched", "grouped")  # harness/runtime/gemm_paths.hpp


def gemm_path_agreement(measured, simulated):
    """A measured run's and its simulated counterpart's expert GEMM calls per library path
    (metrics.gemm_paths_taken: cuda, and a sim whose calibration prices the paths) side by side:
    None unless both record them, else {"agree", "differ", "calls_differ"}. An op both record
    differs in path when its calls do not take the same paths in the same shares ("differ": {op:
    {"measured": {path: calls}, "simulated": ...}}); an op only one side records, or one with the
    same shares but other counts (more steps, another strategy's recompute), is a difference in
    the calls issued, not in the path chosen ("calls_differ": [op]). agree: no op differs in path."""
    mt = measured["metrics"].get("gemm_paths_taken")
    st = simulated["metrics"].get("gemm_paths_taken")
    if mt is None or st is None:
        return None

    def same_shares(a, b):
        ta, tb = sum(a.values()), sum(b.values())
        return set(a) == set(b) and all(a[p] * tb == b[p] * ta for p in a)

    differ = {op: {"measured": mt[op], "simulated": st[op]}
              for op in sorted(set(mt) & set(st)) if not same_shares(mt[op], st[op])}
    calls = [op for op in sorted(set(mt) | set(st))
             if op not in differ and mt.get(op) != st.get(op)]
    return {"agree": not differ, "differ": differ, "calls_differ": calls}


def gemm_path_tally(rows):
    """Over rows that may carry gemm_path_agreement's result as "gemm_paths": {"configurations":
    those compared, "agree": how many agree}, or None when none was compared."""
    compared = [r["gemm_paths"] for r in rows if "gemm_paths" in r]
    return {"configurations": len(compared), "agree": sum(g["agree"] for g in compared)} if compared else None


def validation_measured_files(d):
    """DIR/measured/cN.json of a validation folder (scripts/validate_sim.sh): the measured
    configurations, in order, not their routing traces (cN.routing.json) or stray files."""
    return sorted(p for p in glob.glob(os.path.join(d, "measured", "c*.json"))
                  if re.fullmatch(r"c[0-9]+\.json", os.path.basename(p)))


def _check_run(c, r, w, labels, models, has_grid):
    """One entry of "runs" (or one with its "quick" fields over it)."""
    c.label(r, "id", w)
    backend = c.string(r, "backend", w, choices=BACKENDS)
    if "models" in r:
        if "workloads" in r:
            c.fail(f"{w}.models", 'a run gives "workloads" (MoE layers) or "models" (whole models), not both')
        _check_models(c, r, w)
    elif "pipeline" in r:
        c.fail(f"{w}.pipeline", 'pipeline flags are a whole model\'s ("models"), not an MoE layer\'s')
    _check_pipeline(c, r, w)
    for j, wl in enumerate(c.array(r, "workloads", w, nonempty=True) if "models" not in r else []):
        if isinstance(wl, dict):
            if not has_grid:
                c.fail(f"{w}.workloads[{j}]", "a generated workload (an object) needs the suite's \"grid\"")
            mn = c.string(wl, "model", f"{w}.workloads[{j}]")
            if mn not in models:
                c.fail(f"{w}.workloads[{j}].model", f'{_kind(mn)} is not in grid.models ({", ".join(models)})')
            c.string(wl, "dtype", f"{w}.workloads[{j}]", choices=DTYPES)
            c.integer(wl, "tokens_per_rank", f"{w}.workloads[{j}]", minimum=1)
        elif not isinstance(wl, str) or not _is_label(wl):
            c.fail(f"{w}.workloads[{j}]", f"expected a workload name, a path or an object, got {_kind(wl)}")
    impls = c.strings(r, "impls", w, nonempty=True)
    for j, lab in enumerate(impls):
        if lab not in labels:
            c.fail(f"{w}.impls[{j}]", f'{_kind(lab)} is not a label of the suite\'s "impls" ({", ".join(labels)})')
    if c.name(r, "label", w, required=False) is not None and len(impls) != 1:
        c.fail(f"{w}.label", f"a run's label names its one implementation's results; this run has {len(impls)}")
    _, mode = c.get(r, "mode", w, required=False)
    if mode is not ABSENT:
        if "models" not in r:
            c.fail(f"{w}.mode", 'training or inference is a whole model\'s ("models"), not an MoE layer\'s')
        modes = [mode] if isinstance(mode, str) else mode
        if not isinstance(modes, list) or not modes or any(m not in RUN_MODES for m in modes) \
                or len(set(modes)) != len(modes):
            c.fail(f"{w}.mode", f'expected "training", "inference" or a list of both, got {_kind(mode)}')
    c.integer(r, "warmup", w, required=False, minimum=0)
    if backend == "sim":
        c.strings(r, "clusters", w, nonempty=True, names=True)
    elif "clusters" in r:
        c.fail(f"{w}.clusters", f'only sim runs have clusters, this one runs on "{backend}"')
    for j, n in enumerate(c.array(r, "ranks", w, required=(backend != "sim"), nonempty=True) or []):
        if n != "hostfile" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            c.fail(f"{w}.ranks[{j}]", f'expected a positive integer or "hostfile", got {_kind(n)}')
    c.integer(r, "steps", w, required=False, minimum=1)
    c.boolean(r, "trace", w, required=False)
    # moelab run --gemm-path: the experts' GEMMs pinned to one cuBLAS path (cuda, and its pricing on sim).
    if c.string(r, "gemm_path", w, required=False, choices=GEMM_PATHS) is not None and backend not in ("cuda", "sim"):
        c.fail(f"{w}.gemm_path", f'a GEMM path is a cuBLAS one (cuda, or its pricing on sim), this run is on "{backend}"')
    _check_path_template(c, f"{w}.path", c.string(r, "path", w))


# A system against a baseline. relative_throughput: baseline step time / system step time, as
# speedup, judged in size only (a claim that a cost is negligible has no direction);
# activation_saving: 1 - the system's peak activation bytes / the baseline's (pipelined runs).
PAIR_METRICS = ("speedup", "memory_saving", "exchange_speedup", "all_to_all_speedup", "relative_throughput",
                "activation_saving")
UNDIRECTED_METRICS = ("relative_throughput",)
# Speed-ups, judged in size on their gain (speed-up - 1; scripts/run_suite.py judge).
GAIN_METRICS = ("speedup", "exchange_speedup", "all_to_all_speedup")
RUN_METRICS = PAIR_METRICS + ("overlap_ratio", "all_to_all_share", "all_to_all_overlap")  # the last three: one system's
STATS = ("max", "mean", "min")


def _check_directed(c, it, w, metric, paper):
    """A directed claim (run_suite.judge) says the system is faster or saves memory: its paper
    figure must be on that side of no change, or ours could never agree in direction with it."""
    if metric in GAIN_METRICS and not paper > 1:
        c.fail(f"{w}.paper", f"a {metric} claim is judged as a gain over 1 (faster), got {paper}")
    if metric in ("memory_saving", "activation_saving") and not paper > 0:
        c.fail(f"{w}.paper", f"a {metric} claim is judged as a saving above 0, got {paper}")


def _check_run_claim(c, it, w, run_labels_):
    """A claim judged on a suite's whole-model runs ("on": "runs"; scripts/run_suite.py
    claims_table): the system's label or labels, the baseline's, the selection, the statistic."""
    metric = c.string(it, "metric", w, choices=RUN_METRICS)
    _, sy = c.get(it, "system", w)
    systems = [sy] if isinstance(sy, str) else sy
    if not isinstance(systems, list) or not systems or not all(isinstance(x, str) for x in systems):
        c.fail(f"{w}.system", f"expected a run label or a list of them, got {_kind(sy)}")
    for lab in systems:
        if lab not in run_labels_:
            c.fail(f"{w}.system", f'{_kind(lab)} is not the label of a run with "models" '
                                  f'({", ".join(sorted(run_labels_)) or "none"})')
    vs = c.string(it, "versus", w, required=metric in PAIR_METRICS, null=metric not in PAIR_METRICS)
    if vs is not None:
        if metric not in PAIR_METRICS:
            c.fail(f"{w}.versus", f"{metric} is one system's figure: no baseline, got {_kind(vs)}")
        if vs not in run_labels_:
            c.fail(f"{w}.versus", f'{_kind(vs)} is not the label of a run with "models" '
                                  f'({", ".join(sorted(run_labels_)) or "none"})')
    c.string(it, "stat", w, choices=STATS)
    paper = c.number(it, "paper", w, positive=True)
    _check_directed(c, it, w, metric, paper)
    rng = c.array(it, "paper_range", w, required=False)
    if rng is not None and (len(rng) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     and math.isfinite(v) for v in rng)
                            or not 0 < rng[0] <= paper <= rng[1]):
        c.fail(f"{w}.paper_range", f"expected [low, high] with 0 < low <= paper ({paper}) <= high, got {_kind(rng)}")
    for k in ("text", "source"):
        c.string(it, k, w)
    _check_select(c, it, w)


def _check_select(c, it, w):
    """A claim's "select" (optional): which whole-model runs it is judged on."""
    sel = c.obj(it, "select", w, required=False) or {}
    c.strings(sel, "clusters", f"{w}.select", required=False, nonempty=True, names=True)
    c.strings(sel, "models", f"{w}.select", required=False, nonempty=True, names=True)
    c.string(sel, "mode", f"{w}.select", required=False, choices=RUN_MODES)
    for k in sel:
        if k not in ("clusters", "models", "mode"):
            c.fail(f"{w}.select.{k}", "not a selection field (clusters, models, mode)")


def check_suite(s, path):
    """Raises SchemaError unless s is a well-formed moelab.suite/2; returns s.

    Checks every cross-reference (a sweep's clusters and models, a run's implementations,
    a claim's systems), every name that becomes part of a file's path, and every field that
    scripts/run_suite.py, plots/figures.py and plots/report.py read, so that a mistake in the
    data is named before anything runs."""
    c = _Checker(path)
    c.schema(s, SUITE_SCHEMA)
    name = c.string(s, "name")
    if not re.match(r"^[a-z0-9][a-z0-9_-]*$", name):
        c.fail("name", f'expected lower-case letters, digits, "-" and "_", got {_kind(name)}')
    c.string(s, "description")
    out = c.string(s, "out")
    if os.path.isabs(out) or ".." in out.split("/") or not out.strip("/") or any(ord(ch) < 32 for ch in out):
        c.fail("out", f"expected a folder inside the results folder, got {_kind(out)}")
    paper = c.obj(s, "paper", required=False)
    if paper:
        c.string(paper, "title", "paper")
        c.string(paper, "venue", "paper", required=False)
    impls = c.array(s, "impls", nonempty=True)
    for i, im in enumerate(impls):
        w = f"impls[{i}]"
        c.name(im, "label", w)
        c.string(im, "impl", w)
        c.obj(im, "options", w)
        c.string(im, "kind", w, choices=("baseline", "system"))
        if c.string(im, "requires_option", w, required=False):
            c.string(im, "skip_note", w)
    labels = [im["label"] for im in impls]
    _names(c, labels, "impls")

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
            c.name(m, "name", f"grid.models[{i}]")
            c.integer(m, "d_model", f"grid.models[{i}]", minimum=1)
            c.integer(m, "d_hidden", f"grid.models[{i}]", minimum=1)
        models = [m["name"] for m in grid["models"]]
        _names(c, models, "grid.models")
        clusters = c.array(grid, "clusters", "grid", nonempty=True)
        for i, cl in enumerate(clusters):
            c.name(cl, "name", f"grid.clusters[{i}]")
            c.integer(cl, "gpus", f"grid.clusters[{i}]", minimum=1)
        cnames = [cl["name"] for cl in clusters]
        _names(c, cnames, "grid.clusters")
        c.integer(grid, "global_tokens_as_gpus", "grid", required=False, minimum=1)
        for j, lab in enumerate(c.strings(grid, "impls", "grid", nonempty=True)):
            if lab not in labels:
                c.fail(f"grid.impls[{j}]", f'{_kind(lab)} is not a label of the suite\'s "impls" ({", ".join(labels)})')
        for key in ("sweeps", "quick_sweeps"):
            sweeps = c.array(grid, key, "grid", nonempty=(key == "sweeps"), required=(key == "sweeps")) or []
            for i, sw in enumerate(sweeps):
                w = f"grid.{key}[{i}]"
                c.label(sw, "name", w)
                if key == "sweeps":
                    c.boolean(sw, "extended", w, required=False)
                for j, cn in enumerate(c.strings(sw, "clusters", w, nonempty=True)):
                    if cn not in cnames:
                        c.fail(f"{w}.clusters[{j}]", f'{_kind(cn)} is not in grid.clusters ({", ".join(cnames)})')
                for j, mn in enumerate(c.strings(sw, "models", w, nonempty=True)):
                    if mn not in models:
                        c.fail(f"{w}.models[{j}]", f'{_kind(mn)} is not in grid.models ({", ".join(models)})')
                for j, dt in enumerate(c.array(sw, "dtypes", w, nonempty=True)):
                    if dt not in DTYPES:
                        c.fail(f"{w}.dtypes[{j}]", f'expected fp32, tf32 (fp32 with TF32 GEMMs) or bf16, got {_kind(dt)}')
                for j, b in enumerate(c.array(sw, "tokens_per_gpu", w, nonempty=True)):
                    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                        c.fail(f"{w}.tokens_per_gpu[{j}]", f"expected a positive integer, got {_kind(b)}")

    runs = c.array(s, "runs", required=False) or []
    for i, r in enumerate(runs):
        w = f"runs[{i}]"
        _check_run(c, r, w, labels, models, grid is not None)
        q = r.get("quick", False)
        if c.boolean(r, "extended", w, required=False) and q is not False:
            c.fail(f"{w}.extended", 'an extended run is not in the default run, so it cannot be in the quick subset '
                   '(leave out "quick")')
        if isinstance(q, dict):
            # The quick subset runs the entry with these fields over it (scripts/run_suite.py
            # expand()): the result must be a valid run of the same id.
            for k in q:
                if k in ("id", "quick"):
                    c.fail(f"{w}.quick.{k}", f'"{k}" cannot be overridden in the quick subset')
            _check_run(c, {**r, **q}, f"{w}.quick", labels, models, grid is not None)
        elif not isinstance(q, bool):
            c.fail(f"{w}.quick", f"expected true, false or an object of fields to override, got {_kind(q)}")
    _names(c, [r["id"] for r in runs], "runs")
    if grid is None and not runs:
        c.fail("grid", 'a suite needs a "grid", "runs", or both')

    run_label_set = {lab for r in runs if isinstance(r, dict) and "models" in r for lab in run_labels(r)}
    claims = c.obj(s, "claims", required=False)
    if claims is not None:
        c.number(claims, "size_tolerance", "claims", minimum=0)
        c.string(claims, "source", "claims", required=False)
        c.obj(claims, "paper_setup", "claims", required=False)
        pub = c.obj(claims, "as_published", "claims", required=False)
        for base, lab in (pub or {}).items():
            for k, v in (("key", base), ("value", lab)):
                if v not in labels:
                    c.fail(f"claims.as_published.{base}", f'{k} {_kind(v)} is not a label of the suite\'s "impls"')
        for i, it in enumerate(c.array(claims, "items", "claims", nonempty=True)):
            w = f"claims.items[{i}]"
            c.label(it, "id", w)
            for k in ("text", "source"):
                c.string(it, k, w)
            if c.string(it, "on", w, required=False, choices=("grid", "runs")) == "runs":
                _check_run_claim(c, it, w, run_label_set)
                continue
            for k in ("system", "versus"):
                lab = c.string(it, k, w)
                if lab not in labels:
                    c.fail(f"{w}.{k}", f'{_kind(lab)} is not a label of the suite\'s "impls"')
            if c.string(it, "metric", w, choices=PAIR_METRICS) == "memory_saving":
                c.string(it, "memory_counts", w, required=False, choices=("tracked", "with_optimizer_state"))
                c.string(it, "memory_counts_source", w, required=False)
            c.string(it, "stat", w, choices=STATS)
            _check_directed(c, it, w, it["metric"], c.number(it, "paper", w, positive=True))  # judged as a ratio to it
        _names(c, [it["id"] for it in claims["items"]], "claims.items")

    for i, fg in enumerate(c.array(s, "figures", required=False) or []):
        w = f"figures[{i}]"
        c.label(fg, "id", w)
        c.string(fg, "script", w)
        c.strings(fg, "args", w)
        c.strings(fg, "files", w, nonempty=True)
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
    return f"{v:.2f}x" if metric in ("speedup", "exchange_speedup", "all_to_all_speedup", "relative_throughput") \
        else f"{100 * v:.0f}%"


def selection_text(sel):
    """A claim's selection of runs in words: "pcie-a30x1, training, gpt2-moe-small + 1 more"."""
    sel = sel or {}
    parts = [", ".join(sel["clusters"]) if sel.get("clusters") else "every cluster",
             sel.get("mode") or "training and inference"]
    ms = sel.get("models")
    parts.append("every model" if not ms else ", ".join(ms))
    return "; ".join(parts)


def claim_rows(summary):
    """One dict of display strings per claim of a summary: what both tables show."""
    rows = []
    for c in summary.get("claims", []):
        scope = c.get("compared_on", "all_points")
        o = c["ours"].get(scope, {"points": 0})
        setup = c.get("paper_setup") or {}
        if scope == "runs":
            used = o.get("used", []) if o.get("points") else []
            on = f"runs ({selection_text(c.get('select'))})" + (": " + ", ".join(used) if used else "")
        else:
            on = ("the paper's setup" + (" (" + ", ".join(str(v) for v in setup.values()) + ")" if setup else "")
                  if scope == "paper_setup" else "every point of the run")
        rng = c.get("paper_range")
        paper = (f"{fmt_claim(c['metric'], rng[0])} to {fmt_claim(c['metric'], rng[1])}" if rng
                 else fmt_claim(c["metric"], c["paper"]))
        yn = {True: "yes", False: "no", None: "-"}
        # Against the as-published baseline (claims.as_published), and the other way of counting
        # memory: display strings, empty where the claim has none.
        pub = c.get("as_published")
        published = ""
        if pub:
            po = pub["ours"].get(pub.get("compared_on", scope), {"points": 0})
            published = (f"{fmt_claim(c['metric'], po['value'])} vs {pub['versus']}: {pub['verdict']}"
                         if po.get("points") else f"not run ({pub['versus']})")
        counts = ""
        if c["metric"] == "memory_saving":
            counts = {"tracked": "peak without optimizer state",
                      "with_optimizer_state": "peak with Adam's state"}[c.get("memory_counts", "tracked")]
            oc = c.get("other_counting")
            if oc:
                oo = oc["ours"].get(scope, {"points": 0})
                if oo.get("points"):
                    counts += (f"; {'with' if oc['memory_counts'] == 'with_optimizer_state' else 'without'} it: "
                               f"{fmt_claim(c['metric'], oo['value'])}")
        rows.append({"suite": summary["suite"], "id": c["id"], "claim": c["text"], "source": c["source"],
                     "published": published, "counts": counts,
                     "paper": paper,
                     "ours": fmt_claim(c["metric"], o["value"]) if o.get("points") else "not run",
                     "points": str(o.get("points", 0)), "on": on, "scope": scope,
                     "mode": c.get("mode", summary.get("mode")),
                     "direction": yn[c["direction_agrees"]], "size": yn[c["size_agrees"]], "verdict": c["verdict"]})
    return rows


# ---- whole-model runs: the figures a ScMoE comparison reads ---------------------------------

MOE_PHASES = ("gate", "dispatch", "experts", "combine")


def all_to_all_share(phases):
    """(dispatch + combine) / (gate + dispatch + experts + combine) of a run's phases_s: the
    all-to-all's share of the MoE layers' op time (ScMoE's "all-to-all is ~60% of MoE time on
    A30"). None when the run has no MoE phases."""
    total = sum(phases.get(k, 0.0) for k in MOE_PHASES)
    return (phases.get("dispatch", 0.0) + phases.get("combine", 0.0)) / total if total > 0 else None


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _intersection(u, v):
    """Length of the intersection of two unions of disjoint sorted intervals."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if hi > lo:
            total += hi - lo
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def all_to_all_overlap(trace_path):
    """The all-to-all's overlap ratio of a Chrome trace (moelab run --trace): per rank, the
    union of its all-to-all ops (args.kind "collective", name all_to_all*) intersected with
    the union of its compute stream's other ops, over the union of its all-to-alls, summed
    over ranks (the result's overlap_ratio restricted to the all-to-all, so that a model
    run's gradient all-reduce does not count). None when the trace has no all-to-all.
    Raises SchemaError naming the file when it is not a trace."""
    doc = load_json(trace_path)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise SchemaError(f"{trace_path}: field \"traceEvents\": expected a list of trace events")
    names, a2a, comp = {}, {}, {}
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("ph") == "M" and e.get("name") == "thread_name" and isinstance(e.get("args"), dict):
            names[(e.get("pid"), e.get("tid"))] = e["args"].get("name")
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ts, dur)):
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        iv = (ts, ts + dur)
        if args.get("kind") == "collective" and str(e.get("name", "")).startswith("all_to_all"):
            a2a.setdefault(e.get("pid"), []).append(iv)
        elif names.get((e.get("pid"), e.get("tid"))) == "compute" and args.get("kind") != "collective":
            comp.setdefault(e.get("pid"), []).append(iv)
    hidden = total = 0.0
    for rank, ivs in a2a.items():
        u = _union(ivs)
        total += sum(b - a for a, b in u)
        hidden += _intersection(u, _union(comp.get(rank, [])))
    return hidden / total if total > 0 else None


def run_key(row):
    """What a system's whole-model run is paired with its baseline's by: the model (compared
    name), the layers, the cluster (or ranks) and the run mode."""
    return (row.get("model"), row.get("layers"), row.get("cluster") or row.get("ranks"), row.get("run_mode"))


def selected(row, sel):
    """Whether a summary's run row is one a claim's selection (clusters, mode, models) takes."""
    sel = sel or {}
    return ((not sel.get("clusters") or row.get("cluster") in sel["clusters"])
            and (not sel.get("mode") or row.get("run_mode") == sel["mode"])
            and (not sel.get("models") or row.get("model") in sel["models"]))


def point_name(row):
    """A run row as a claim lists the points it used: "pcie-a30x1 training gpt2-moe-small [2:4]"."""
    return " ".join(str(x) for x in (row.get("cluster") or f"np {row.get('ranks')}", row.get("run_mode"),
                                     row.get("model")) if x) + (f" [{row['layers']}]" if row.get("layers") else "")


def offload_note(row):
    """What a pipelined run with offload really moved, for a claim's list of points: " (19 of 32
    planned offloads kept)"; a claim that offloading costs little or saves much is only as good
    as the share the gap and lifespan rules kept. "" for a run without offload or a summary
    written before the counts were (docs/RESULTS-SCHEMA.md)."""
    off = (row.get("results") or {}).get("offload")
    if not isinstance(off, dict):
        return ""
    kept, planned = off.get("kept"), off.get("planned")
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (kept, planned)) or planned <= 0:
        return ""
    return f" ({kept} of {planned} planned offloads kept)"


def run_comparisons(runs, systems, versus, metric, sel=None, used=None):
    """[(point name, value)] of a metric over the whole-model run rows (with results) of the
    systems' labels that the selection takes: for speedup and memory_saving each paired with
    versus's run of the same run_key; otherwise the system's own figure. A run with offload
    names the share of its planned offloads it kept (offload_note)."""
    done = [r for r in runs if "results" in r and r.get("run_mode") and selected(r, sel)]
    base = {}
    for r in done:
        if r.get("label") == versus:
            if run_key(r) in base:  # two baseline runs a system run could be paired with
                raise SchemaError(f"claim on runs: two {versus} runs at {point_name(r)} (they differ in layout, "
                                  "pipeline or override); give each its own label so that a claim pairs one")
            base[run_key(r)] = r
    out = []
    for r in done:
        if r.get("label") not in systems:
            continue
        f = r["results"]
        if metric in PAIR_METRICS:
            b = base.get(run_key(r))
            if b is None:
                continue
            v = (b["results"]["step_time_s"] / f["step_time_s"]
                 if metric in ("speedup", "relative_throughput") and f["step_time_s"] > 0
                 else 1.0 - f["peak_activation_bytes"] / b["results"]["peak_activation_bytes"]
                 if metric == "activation_saving" and b["results"].get("peak_activation_bytes")
                 and f.get("peak_activation_bytes") is not None
                 else 1.0 - f["peak_memory_bytes"] / b["results"]["peak_memory_bytes"]
                 if metric == "memory_saving" and b["results"]["peak_memory_bytes"] > 0
                 else b["results"]["exchange_s"] / f["exchange_s"]
                 if metric == "exchange_speedup" and f.get("exchange_s") and b["results"].get("exchange_s")
                 else b["results"]["all_to_all_s"] / f["all_to_all_s"]
                 if metric == "all_to_all_speedup" and f.get("all_to_all_s") and b["results"].get("all_to_all_s") else None)
        else:
            v = f.get(metric)
        if v is not None:
            out.append((point_name(r) + (f" {r['label']}" if len(systems) > 1 else "") + offload_note(r), v))
            if used is not None:  # the rows each value came from: the system's run and its baseline's
                used += [r] + ([base[run_key(r)]] if metric in PAIR_METRICS else [])
    return out


def run_comparison_gaps(runs, systems, versus, metric, sel=None):
    """What run_comparisons could not use: each selected run of the systems (and, for a pair
    metric, the baseline's run it pairs with) that has no result, as "<point> <label>: <why>"
    (skipped, out of device memory, failed), so that a claim says it was judged without them."""
    rows = [r for r in runs if r.get("run_mode") and selected(r, sel)]
    base = {run_key(r): r for r in rows if r.get("label") == versus}
    out = []

    def why(r):
        return "out of device memory" if r.get("out_of_memory") else "failed" if r.get("failed") else "no result"

    for r in rows:
        if r.get("label") not in systems:
            continue
        if "results" not in r:
            gap = f"{point_name(r)} {r.get('label')}: {why(r)}"
        elif metric in PAIR_METRICS and run_key(r) in base and "results" not in base[run_key(r)]:
            b = base[run_key(r)]
            gap = f"{point_name(b)} {b.get('label')}: {why(b)}"
        else:
            continue
        if gap not in out:  # a baseline run several systems pair with is missing once
            out.append(gap)
    return out


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


def calibration_words(cal):
    """How a simulated result was priced, in words: a result's "calibration" is the name of the
    measured profile it used, or "datasheet" when none; without a profile the cluster file's
    own models price it (datasheet figures, or a GEMM calibration fitted to published and our
    measurements: experiments/hardware/calibration/)."""
    if not cal or cal == "datasheet":
        return "cluster-file models, no measured profile"
    return f"measured profile {cal}"
