"""scripts/tests/fixtures.py — small, valid files of every format, for the python tests.

Built in code so that no test depends on the committed results staying as they are.
"""
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.dirname(HERE)
ROOT = os.path.dirname(SCRIPTS)
sys.path.insert(0, SCRIPTS)

TINY_PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                         "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082")


def result(mode="simulated", step=0.005, device=None):
    sim = mode == "simulated"
    return copy.deepcopy({
        "schema": "moelab.result/1",
        "mode": mode,
        "backend": "sim" if sim else "cpu",
        "device": device or ("simulated A100-SXM4-40GB in dgx-a100x1" if sim else "AMD EPYC (2 threads, OpenBLAS)"),
        "cluster": {"name": "dgx-a100x1", "nodes": 1} if sim else None,
        "calibration": "datasheet" if sim else None,
        **({"routing_model": "uniform"} if sim else {}),
        "commit": "0123456789ab",
        "date": "2026-11-22T04:40:30Z",
        "world_size": 2,
        "workload": {"name": "tiny", "description": "a test layer", "tokens_per_rank": 512, "steps": 1,
                     "warmup": 1, "seed": 1, "expert_parallel": 0,
                     "model": {"name": "moe", "d_model": 64, "d_hidden": 256, "num_experts": 8, "top_k": 2,
                               "capacity_factor": 1.25, "activation": "gelu", "dtype": "fp32"}},
        "impl": "mpipemoe",
        "impl_report": {"partitions": "auto", "last_n": 2, "strategy": "auto", "last_strategy": "S3",
                        "granularity_search": {"decisions": [{"n": 2, "trials": [{"n": 1, "seconds": 0.002},
                                                                                  {"n": 2, "seconds": 0.0019}]}]}},
        "metrics": {
            "step_time_s": {"median": step, "mean": step, "min": step, "max": step, "all": [step]},
            "tokens_per_s": 1024 / step,
            "phases_s": {"gate": 0.0001, "dispatch": 0.0008, "experts": 0.004, "combine": 0.0006},
            "stream_busy_s": {"compute": 0.0045, "dispatch": 0.0008, "combine": 0.0006},
            "comm_s": 0.0014, "compute_busy_s": 0.0044, "exposed_comm_s": 0.0006, "overlap_ratio": 0.55,
            "overlap_limit_s": 0.0045, "host_copy_s": 0.0, "expert_tflops": 12.5, "expert_gemm_tflops": 13.0,
            "expert_gemm_s": 0.0039, "bare_gemm_s": 0.0035, "bare_gemm_library": "GEMM (cost model)",
            "expert_vs_bare_ratio": 1.11,
            "peak_memory_bytes": {"device_total": 162338052, "rank": 1,
                                  "by_category_at_peak": {"activations": 100, "buffers": 50, "weights": 10},
                                  "peak_per_category": {"activations": 120, "buffers": 50, "weights": 10}},
            "routing": {"dropped": 0, "capacity": 0, "recv_per_local_expert": [510, 514]},
        },
    })


def model_result(mode="simulated"):
    """A pipelined whole-model run (moelab run --model --parallel pp=2,dp=2)."""
    sim = mode == "simulated"
    r = result(mode)
    del r["workload"]
    r["world_size"] = 4
    r["model"] = {"name": "tiny-moe", "d_model": 64, "num_layers": 2, "seq_len": 32, "vocab_size": 256, "dtype": "fp32"}
    r["training"] = {"layers": [0, 2], "micro_batch": 1, "microbatches": 4, "optimizer": "adam", "lr": 0.001,
                     "seed": 1, "steps": 1, "warmup": 1}
    links = {"nvlink": 1.5e6, "pcie": 0.0, "nic": 0.0} if sim else None
    by = {"all_to_all": {"nvlink": 1.0e6, "pcie": 0.0, "nic": 0.0},
          "send_recv": {"nvlink": 0.5e6, "pcie": 0.0, "nic": 0.0}} if sim else None
    stage = {"work_s": 0.003, "span_s": 0.004, "bubble": 0.25, "peak_activation_bytes": 1000,
             "peak_buffer_bytes": 500, "peak_device_bytes": 9000, "microbatches_in_flight": 2, "link_bytes": links,
             "link_bytes_by_collective": by}
    r["parallel"] = {
        "layout": {"world": 4, "tp": 1, "pp": 2, "dp": 2, "dp_inferred": False, "ep": 2, "etp": 1, "edp": 1},
        "spec": "tp=1,pp=2,dp=2,ep=2,etp=1,edp=1",
        "schedule": {"name": "1f1b", "stages": 2, "microbatches": 4, "chunks": 1, "placement": "interleaved",
                     "recompute": "none"},
        "bubble": 0.25, "pipeline_window_s": 0.004,
        "stages": [dict(stage, stage=0, ranks=[0, 1]), dict(stage, stage=1, ranks=[2, 3])],
        "link_bytes": links,
        "link_bytes_by_collective": by,
        "sequence_parallel": False,
        "gradient_sync": {"kind": "bucketed_all_reduce", "bucket_elems": 40000000},
    }
    return r


def figures(step, peak, n=None):
    f = {"step_time_s": step, "peak_memory_bytes": peak, "overlap_ratio": 0.5, "comm_s": 0.001,
         "compute_busy_s": step * 0.8, "exposed_comm_s": 0.0005, "overlap_limit_s": step * 0.9,
         "phases_s": {"gate": 0.0001, "dispatch": 0.001, "experts": step * 0.7, "combine": 0.001}}
    if n is not None:
        f["partitions"] = n
    return f


def summary(subset="full", suite="fake", system_step=0.004):
    pt = {"sweep": "paper", "cluster": "dgx-a100x8", "gpus": 64, "model": "M", "dtype": "fp32",
          "tokens_per_gpu": 2048, "tokens_per_rank": 2048, "global_tokens": 131072,
          "results": {"Base": {**figures(0.008, 2000), "file": "simulated/fake/dgx-a100x8/M-fp32-T2048-Base.json"},
                      "Sys": {**figures(system_step, 1500, 2), "file": "simulated/fake/dgx-a100x8/M-fp32-T2048-Sys.json"}},
          "speedup": {"Sys_vs_Base": 0.008 / system_step}, "memory_saving": {"Sys_vs_Base": 0.25}, "skipped": []}
    pt2 = {**copy.deepcopy(pt), "cluster": "dgx-a100x1", "gpus": 8, "tokens_per_rank": 16384, "sweep": "scaling"}
    return {
        "schema": "moelab.suite-summary/1", "suite": suite, "suite_file": f"experiments/{suite}/suite.json",
        "subset": subset, "mode": "mixed", "backends": ["cpu", "sim"], "calibration": "datasheet",
        "routing_model": "uniform", "commit": "0123456789ab", "date": "2026-11-22T05:00:00Z", "host_seconds": 3.0,
        "skipped": [{"run": "gpu", "reason": "no CUDA device here", "count": 1}],
        "points": [pt] if subset == "quick" else [pt, pt2],
        "runs": [
            {"id": "cpu", "impl": "Base", "impl_name": "fastmoe", "options": {}, "workload": "tiny", "backend": "cpu",
             "cluster": None, "ranks": 4, "mode": "measured", "device": "AMD EPYC (2 threads, OpenBLAS)",
             "calibration": None, "world_size": 4, "file": "measured/cpu/tiny-Base-np4.json",
             "results": figures(0.03, 5000000)},
            {"id": "gpu", "impl": "Base", "impl_name": "fastmoe", "options": {}, "workload": "tiny", "backend": "cuda",
             "cluster": None, "ranks": 1, "skipped": "no CUDA device here"},
        ],
        "claims": [{"id": "sys-speedup", "system": "Sys", "versus": "Base", "metric": "speedup", "stat": "max",
                    "paper": 2.8, "text": "up to 2.8x faster than Base", "source": "Fake et al., Figure 7",
                    "mode": "simulated", "paper_setup": {"cluster": "dgx-a100x8", "dtype": "fp32"},
                    "ours": {"paper_setup": {"points": 1, "value": 0.008 / system_step},
                             "all_points": {"points": 2, "value": 0.008 / system_step}},
                    "compared_on": "paper_setup", "direction_agrees": True, "size_agrees": False,
                    "verdict": "agrees in direction, ours is 0.71x the paper's figure"}],
    }


def suite(name="fake"):
    return {
        "schema": "moelab.suite/2", "name": name, "description": "A test suite.", "out": f"simulated/{name}",
        "impls": [{"label": "Base", "impl": "fastmoe", "options": {}, "kind": "baseline"},
                  {"label": "Sys", "impl": "mpipemoe", "options": {"partitions": 2}, "kind": "system"}],
        "grid": {"impls": ["Base", "Sys"],
                 "workload_defaults": {"num_experts": 8, "top_k": 1, "capacity_factor": 0, "activation": "gelu",
                                       "steps": 1, "warmup": 1, "seed": 1, "expert_parallel": 0},
                 "models": [{"name": "M", "d_model": 32, "d_hidden": 64}],
                 "clusters": [{"name": "dgx-a100x1", "gpus": 8}],
                 "sweeps": [{"name": "s", "clusters": ["dgx-a100x1"], "models": ["M"], "dtypes": ["fp32", "bf16"],
                             "tokens_per_gpu": [256]}],
                 "quick_sweeps": [{"name": "q", "clusters": ["dgx-a100x1"], "models": ["M"], "dtypes": ["bf16"],
                                   "tokens_per_gpu": [256]}]},
        "runs": [{"id": "sim", "backend": "sim", "clusters": ["dgx-a100x1"], "ranks": [2], "workloads": ["tiny"],
                  "impls": ["Base"], "steps": 1, "trace": True, "path": "simulated/{cluster}/{workload}-{impl}",
                  "quick": True},
                 {"id": "gpu", "backend": "cuda", "workloads": ["tiny"], "impls": ["Base"], "ranks": [1],
                  "path": "measured/cuda/{device}/{workload}-{impl}-np{ranks}"}],
        "claims": {"source": "Fake et al.", "size_tolerance": 0.25,
                   "paper_setup": {"cluster": "dgx-a100x1", "dtype": "fp32"},
                   "items": [{"id": "sys-speedup", "system": "Sys", "versus": "Base", "metric": "speedup",
                              "stat": "max", "paper": 2.8, "text": "up to 2.8x faster than Base",
                              "source": "Fake et al., Figure 7"}]},
        "figures": [{"id": "bars", "script": "plots/runs.py", "args": ["--summary", "{summary}"],
                     "files": ["fake-*.png"], "caption": "Bars of the fake suite.", "mode": "simulated",
                     "headline": True}],
    }


def model_run_result(step=0.02, model="tiny-moe", layers=(0, 2), impl="top2"):
    """A plain whole-model run (moelab run --model, no --parallel), as a suite's "models" run writes."""
    r = model_result()
    del r["parallel"]
    r["world_size"] = 2
    r["impl"] = impl
    r["impl_report"] = {"schedule": "unpipelined expert parallelism"}
    r["model"]["name"] = model
    r["training"]["layers"] = list(layers)
    r["training"]["microbatches"] = 1
    m = r["metrics"]
    m["step_time_s"] = {"median": step, "mean": step, "min": step, "max": step, "all": [step]}
    m["phases_s"] = {"attention": 0.002, "mlp": 0.001, "gate": 0.0001, "dispatch": 0.0012, "experts": 0.0016,
                     "combine": 0.0011, "grad_sync": 0.004, "optimizer": 0.001}
    return r


def model_row(label, model, cluster, step, run_mode="training", layers=None, overlap=0.1, share=0.5, a2a=None,
              peak=3000, run="r"):
    """A whole-model run's row of a summary (scripts/run_suite.py summarize)."""
    f = {**figures(step, peak), "overlap_ratio": overlap, "all_to_all_share": share}
    if a2a is not None:
        f["all_to_all_overlap"] = a2a
    return {"id": run, "impl": label, "impl_name": "top2", "options": {}, "workload": model, "backend": "sim",
            "cluster": cluster, "ranks": None, "model": model, "model_file": model, "layers": layers,
            "label": label, "run_mode": run_mode, "parallel": None, "override": None, "mode": "simulated",
            "device": f"simulated GPU in {cluster}", "calibration": "datasheet", "world_size": 8,
            "file": f"simulated/fake/{cluster}/{run_mode}/{model}-{label}.json", "results": f}


def model_suite(name="fakemodels"):
    """A suite of whole-model runs (tiny test models, which exist in experiments/models), with
    claims on runs."""
    return {
        "schema": "moelab.suite/2", "name": name, "description": "A test suite of whole models.",
        "out": f"simulated/{name}",
        "impls": [{"label": "top2", "impl": "top2", "options": {}, "kind": "baseline"},
                  {"label": "top1", "impl": "top1", "options": {}, "kind": "baseline"},
                  {"label": "Sc", "impl": "fastmoe", "options": {}, "kind": "system"}],
        "runs": [{"id": "base", "backend": "sim", "clusters": ["pcie-a30x1", "a800x1"], "ranks": [2],
                  "models": [{"file": "tiny-moe", "parallel": {"a800x1": "tp=1,pp=1,ep=2"}},
                             {"file": "tiny-scmoe", "model": "tiny-dense-se", "override": {"scmoe": None},
                              "layers": "0:2"}],
                  "mode": ["training", "inference"], "impls": ["top2", "top1"], "steps": 1, "warmup": 1,
                  "path": "simulated/{cluster}/{run_mode}/{model}-{label}", "quick": True},
                 {"id": "sc", "backend": "sim", "clusters": ["pcie-a30x1", "a800x1"], "ranks": [2],
                  "models": [{"file": "tiny-scmoe", "model": "tiny-moe", "override": {"scmoe": {"position": "pos3"}}},
                             "no-such-model"],
                  "mode": ["training", "inference"], "impls": ["Sc"], "label": "Sc-Pos3", "trace": True,
                  "path": "simulated/{cluster}/{run_mode}/{model}-{label}",
                  "quick": {"clusters": ["pcie-a30x1"]}}],
        "claims": {"source": "Fake et al.", "size_tolerance": 0.25,
                   "items": [{"id": "sc-train", "on": "runs", "system": "Sc-Pos3", "versus": "top2",
                              "metric": "speedup", "stat": "mean",
                              "select": {"clusters": ["pcie-a30x1"], "mode": "training", "models": ["tiny-moe"]},
                              "paper": 1.3, "text": "1.3x faster than top-2", "source": "Fake et al., abstract"},
                             {"id": "sc-overlap", "on": "runs", "system": ["Sc-Pos3"], "metric": "all_to_all_overlap",
                              "stat": "min", "paper": 0.7, "paper_range": [0.7, 1.0],
                              "text": "70% to 100% overlapped", "source": "Fake et al., abstract"},
                             {"id": "share", "on": "runs", "system": "top2", "metric": "all_to_all_share",
                              "stat": "max", "select": {"mode": "training"}, "paper": 0.6,
                              "text": "all-to-all 60% of MoE time", "source": "Fake et al., section 5"}]},
        "figures": [{"id": "speedup", "script": "plots/scmoe.py",
                     "args": ["speedup", "--summary", "{summary}", "--out", "{figures}/fake-speedup.png"],
                     "files": ["fake-speedup.png"], "caption": "Speed-ups.", "mode": "simulated"}],
    }


def model_summary(suite="fakemodels"):
    """A summary of model_suite()'s runs, claims judged."""
    runs = [model_row("top2", "tiny-moe", "pcie-a30x1", 0.010, share=0.6),
            model_row("top1", "tiny-moe", "pcie-a30x1", 0.009, share=0.6),
            model_row("Sc-Pos3", "tiny-moe", "pcie-a30x1", 0.008, a2a=0.8, run="sc"),
            {**model_row("top2", "tiny-moe", "pcie-a30x1", 0.0, run_mode="inference"), "skipped": "no --inference"}]
    del runs[3]["results"], runs[3]["mode"], runs[3]["device"], runs[3]["calibration"], runs[3]["world_size"], \
        runs[3]["file"]
    return {
        "schema": "moelab.suite-summary/1", "suite": suite, "suite_file": f"experiments/{suite}/suite.json",
        "subset": "full", "mode": "simulated", "backends": ["sim"], "calibration": "datasheet",
        "routing_model": "uniform", "commit": "0123456789ab", "date": "2026-11-22T05:00:00Z", "host_seconds": 3.0,
        "skipped": [{"run": "base", "reason": "no --inference", "count": 1}], "points": [], "runs": runs,
        "claims": [{"id": "sc-train", "on": "runs", "system": "Sc-Pos3", "versus": "top2", "metric": "speedup",
                    "stat": "mean", "select": {"clusters": ["pcie-a30x1"], "mode": "training"}, "paper": 1.3,
                    "text": "1.3x faster than top-2", "source": "Fake et al., abstract", "mode": "simulated",
                    "compared_on": "runs",
                    "ours": {"runs": {"points": 1, "value": 1.25, "max": 1.25, "mean": 1.25, "min": 1.25,
                                      "used": ["pcie-a30x1 training tiny-moe: 1.25x"]}},
                    "direction_agrees": True, "size_agrees": True, "verdict": "agrees in direction and size"},
                   {"id": "sc-overlap", "on": "runs", "system": ["Sc-Pos3"], "versus": None,
                    "metric": "all_to_all_overlap", "stat": "min", "paper": 0.7, "paper_range": [0.7, 1.0],
                    "text": "70% to 100% overlapped", "source": "Fake et al., abstract", "mode": "simulated",
                    "compared_on": "runs", "ours": {"runs": {"points": 0}},
                    "direction_agrees": None, "size_agrees": None, "verdict": "not run"}],
    }
