"""Tests of scripts/gpu.sh run and unpack without a GPU, on a stand-in bundle.

    /usr/bin/python3 -m unittest -v test_gpu_sh      (from scripts/tests)

The bundle is made of small shell scripts: a moelab whose `list` reports no CUDA device (or a
fake one) and whose cuda `run` writes a committed result or hangs, and test binaries that write
a GoogleTest XML report, fail or hang. What is checked: every step goes through and says why
it skips; the run packs what it wrote into OUTDIR/gpu-results.tar.gz with summary.txt and
leaves only those and its log (all of it with --keep); the exit code (0 when everything
skipped, 1 on a failed or timed-out step, 2 on bad options); the time budgets stop a hung
binary and a suites step, keeping the runs that finished; unpack puts the cuda results back.
"""
import os
import subprocess
import tarfile
import tempfile
import time
import unittest

import fixtures

GPU_SH = os.path.join(fixtures.SCRIPTS, "gpu.sh")
TESTS = ("cuda_backend_test", "cuda_blocks_test", "gemm_epilogue_test", "host_pool_test", "moe_layer_test", "model_test")
TEMPLATE = os.path.join(fixtures.ROOT, "results", "measured", "cuda", "nvidia-h100-80gb-hbm3",
                        "small-fastmoe-np1.json")

MOELAB = r"""#!/usr/bin/env bash
case "$1" in
  list) printf 'backends (--backend):\n  cpu    stand-in\n  cuda   %s\n' "${FAKE_CUDA:-not available: no CUDA device}" ;;
  run)
    out=""; prev=""
    for a in "$@"; do [ "$prev" = --out ] && out="$a"; prev="$a"; done
    case " $* " in *" --backend cuda "*) ;; *) exit 0 ;; esac
    # The first cuda run writes a result; every later one hangs.
    if [ ! -e "$FAKE_STATE/first" ]; then touch "$FAKE_STATE/first"; cp "$FAKE_TEMPLATE" "$out"; exit 0; fi
    sleep 120 ;;
  *) exit 0 ;;
esac
"""
GTEST = r"""#!/usr/bin/env bash
for a in "$@"; do case "$a" in --gtest_output=xml:*) x="${a#--gtest_output=xml:}" ;; esac; done
cat >"$x" <<'X'
<?xml version="1.0"?><testsuites><testsuite name="S"><testcase name="a" status="run" result="skipped"><skipped/></testcase><testcase name="b" status="run" result="completed"/></testsuite></testsuites>
X
"""
FAILS = "#!/usr/bin/env bash\necho '[  FAILED  ] S.b'\nexit 1\n"
HANGS = "#!/usr/bin/env bash\nsleep 120\n"


class GpuSh(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="gpu_sh_test.")
        self.dir = self.tmp.name
        self.bundle = os.path.join(self.dir, "bundle")
        self.out = os.path.join(self.dir, "out")
        self.state = os.path.join(self.dir, "state")
        os.makedirs(self.state)
        self.make_bundle()

    def tearDown(self):
        self.tmp.cleanup()

    def make_bundle(self, **binaries):
        os.makedirs(self.bundle, exist_ok=True)
        for name in ("moelab",) + TESTS:
            path = os.path.join(self.bundle, name)
            with open(path, "w") as f:
                f.write(binaries.get(name, MOELAB if name == "moelab" else GTEST))
            os.chmod(path, 0o755)

    def gpu_sh(self, *args, **env):
        e = dict(os.environ, FAKE_STATE=self.state, FAKE_TEMPLATE=TEMPLATE, PYTHONDONTWRITEBYTECODE="1")
        for k in ("OUT", "GPU_RUN_BUDGET", "TEST_TIMEOUT") + tuple(f"GPU_BUDGET_{s.upper()}" for s in
                                                                   ("tests", "validate", "suites", "peers", "compare")):
            e.pop(k, None)
        e.update(env)
        t0 = time.monotonic()
        p = subprocess.run(["bash", GPU_SH] + list(args), env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=300)
        p.seconds = time.monotonic() - t0
        return p

    def run_gpu(self, *args, **env):
        return self.gpu_sh("run", self.out, "--bundle", self.bundle, *args, **env)

    def archive(self):
        with tarfile.open(os.path.join(self.out, "gpu-results.tar.gz")) as t:
            return t.getnames()

    def summary(self):
        with open(os.path.join(self.out, "summary.txt")) as f:
            return f.read()

    def row(self, step):
        return next((l.split() for l in self.summary().splitlines() if l.startswith(step + " ")), None)

    def test_without_device_every_step_skips_and_the_run_is_packed(self):
        p = self.run_gpu()
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertEqual(sorted(os.listdir(self.out)), ["gpu-results.tar.gz", "gpu-run.log", "summary.txt"])
        names = self.archive()
        for t in TESTS:
            self.assertIn(f"tests/{t}.xml", names)
        for n in ("moelab-list.txt", "run_suite.log", "summary.txt", "gpu-run.log"):
            self.assertIn(n, names)
        self.assertEqual(self.row("validate")[1], "skipped")
        self.assertEqual(self.row("peers")[1], "skipped")
        self.assertEqual(self.row("suites")[1], "passed")
        self.assertEqual(self.row("compare")[1], "passed")
        for t in TESTS:
            self.assertEqual(self.row(f"tests/{t}")[1], "passed")
        self.assertIn("no CUDA device", self.summary())
        self.assertIn("exit code 0", self.summary())

    def test_keep_leaves_the_files(self):
        p = self.run_gpu("--only", "tests", "--keep")
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertTrue(os.path.isdir(os.path.join(self.out, "tests")))
        self.assertIn("tests/model_test.xml", self.archive())
        self.assertIsNone(self.row("validate"))  # not selected: not in the table

    def test_failed_and_hung_binaries(self):
        self.make_bundle(model_test=FAILS, cuda_blocks_test=HANGS)
        p = self.run_gpu("--only", "tests", TEST_TIMEOUT="2")
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertLess(p.seconds, 60)
        self.assertEqual(self.row("tests/model_test")[1], "FAILED")
        self.assertEqual(self.row("tests/cuda_blocks_test")[1], "TIMEOUT")
        self.assertEqual(self.row("tests/moe_layer_test")[1], "passed")  # the rest still ran
        self.assertIn("tests/model_test.log", self.archive())
        self.assertEqual(sorted(os.listdir(self.out)), ["gpu-results.tar.gz", "gpu-run.log", "summary.txt"])

    def test_tests_budget_spent(self):
        self.make_bundle(cuda_backend_test=HANGS)
        p = self.run_gpu("--only", "tests", GPU_BUDGET_TESTS="3")
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertEqual(self.row("tests/cuda_backend_test")[1], "TIMEOUT")
        self.assertIn("not started", " ".join(self.row("tests/model_test")))

    def test_suites_budget_keeps_the_finished_runs(self):
        p = self.run_gpu("--only", "suites", FAKE_CUDA="available: Stand-in GPU 9 (1.0 GiB)",
                         GPU_RUN_BUDGET="40", GPU_BUDGET_COMPARE="5")
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertLess(p.seconds, 45, p.stdout)
        self.assertEqual(self.row("suites")[1], "TIMEOUT")
        self.assertIn("1 kept from results/candidate/", self.summary())
        self.assertIn("results/measured/cuda/stand-in-gpu-9/small-fastmoe-np1.json", self.archive())
        self.assertEqual(self.row("compare")[1], "passed")

        dest = os.path.join(self.dir, "dest")
        os.makedirs(os.path.join(dest, "measured", "cuda", "stand-in-gpu-9"))
        other = os.path.join(dest, "measured", "cuda", "stand-in-gpu-9", "other.json")
        with open(other, "w") as f:
            f.write("{}")
        u = self.gpu_sh("unpack", os.path.join(self.out, "gpu-results.tar.gz"), dest)
        self.assertEqual(u.returncode, 0, u.stdout)
        self.assertIn("unpacked: measured/cuda/stand-in-gpu-9/", u.stdout)
        self.assertTrue(os.path.exists(os.path.join(dest, "measured", "cuda", "stand-in-gpu-9", "small-fastmoe-np1.json")))
        self.assertTrue(os.path.exists(other))  # files the run did not write are left alone
        self.assertFalse(os.path.exists(os.path.join(dest, "tests")))  # logs stay in the archive

    def test_peers_step_runs_the_peer_with_torch(self):
        """A python3 that imports torch (here a stand-in whose torch sees no device) runs the peer;
        its skip is the step's."""
        fake = os.path.join(self.dir, "faketorch", "torch")
        os.makedirs(fake)
        with open(os.path.join(fake, "__init__.py"), "w") as f:
            f.write("__version__ = '9.9'\nclass cuda:\n    @staticmethod\n    def is_available():\n"
                    "        return False\n")
        p = self.run_gpu("--only", "peers", FAKE_CUDA="available: Stand-in GPU 9 (1.0 GiB)",
                         PYTHONPATH=os.path.dirname(fake))
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertEqual(self.row("peers")[1], "skipped")
        self.assertIn("PyTorch 9.9 sees no CUDA device", self.summary())
        self.assertIn("peers.log", self.archive())

    def test_unpack_without_cuda_results_and_bad_archives(self):
        self.assertEqual(self.run_gpu("--only", "tests").returncode, 0)
        dest = os.path.join(self.dir, "dest")
        u = self.gpu_sh("unpack", os.path.join(self.out, "gpu-results.tar.gz"), dest)
        self.assertEqual(u.returncode, 0, u.stdout)
        self.assertIn("nothing copied", u.stdout)
        self.assertEqual(self.gpu_sh("unpack", os.path.join(self.dir, "none.tar.gz"), dest).returncode, 2)
        junk = os.path.join(self.dir, "junk.tar.gz")
        with open(junk, "w") as f:
            f.write("not an archive")
        u = self.gpu_sh("unpack", junk, dest)
        self.assertEqual(u.returncode, 2)
        self.assertIn("not a readable .tar.gz", u.stdout)

    def test_a_carried_archive_replaces_the_bundle_folder(self):
        """What travels is build-gpu/bundle.tar.gz (gpu.sh bundle): run unpacks it over whatever
        bundle folder an earlier call left on the machine."""
        with tarfile.open(self.bundle + ".tar.gz", "w:gz") as t:
            for n in os.listdir(self.bundle):
                t.add(os.path.join(self.bundle, n), arcname=n)
        self.make_bundle(model_test=FAILS)  # the stale folder: model_test fails there
        with open(os.path.join(self.bundle, "stale"), "w") as f:
            f.write("left by an earlier call")
        p = self.run_gpu("--only", "tests")
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertEqual(self.row("tests/model_test")[1], "passed")
        self.assertFalse(os.path.exists(os.path.join(self.bundle, "stale")))
        with open(self.bundle + ".tar.gz", "w") as f:
            f.write("not an archive")
        p = self.run_gpu("--only", "tests")
        self.assertEqual(p.returncode, 2)
        self.assertIn("cannot unpack", p.stdout)

    def test_unpack_leaves_out_what_is_incomplete(self):
        """A validate or peers step that failed or ran out of time renamed what it wrote
        *.incomplete: unpack never puts it over the complete files of an earlier run."""
        src = os.path.join(self.dir, "src")
        files = {"validation/gpu-a/profile.json": "{}", "validation/gpu-a/comparison.json": "{}",
                 "validation/gpu-b.incomplete/profile.json": "{}",
                 "results/measured/cuda/gpu-a/peers/torch-moe.jsonl.incomplete": "{}\n",
                 "results/measured/cuda/gpu-a/mpipemoe/run.json": "{}", "summary.txt": "s\n"}
        for n, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(src, n)), exist_ok=True)
            with open(os.path.join(src, n), "w") as f:
                f.write(text)
        archive = os.path.join(self.dir, "a.tar.gz")
        with tarfile.open(archive, "w:gz") as t:
            for n in ("validation", "results", "summary.txt"):
                t.add(os.path.join(src, n), arcname=n)
        dest = os.path.join(self.dir, "dest")
        u = self.gpu_sh("unpack", archive, dest)
        self.assertEqual(u.returncode, 0, u.stdout)
        self.assertIn("not unpacked (incomplete): validation/gpu-b.incomplete", u.stdout)
        self.assertIn("not unpacked (incomplete): results/measured/cuda/gpu-a/peers/torch-moe.jsonl.incomplete", u.stdout)
        got = sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs)
        self.assertEqual(got, ["measured/cuda/gpu-a/mpipemoe/run.json", "validation/gpu-a/comparison.json",
                               "validation/gpu-a/profile.json"])

    def test_bad_options(self):
        p = self.run_gpu("--only", "tests,bogus")
        self.assertEqual(p.returncode, 2)
        self.assertIn('unknown step "bogus"', p.stdout)
        p = self.run_gpu(GPU_BUDGET_TESTS="soon")
        self.assertEqual(p.returncode, 2)
        self.assertIn("GPU_BUDGET_TESTS=soon", p.stdout)
        p = self.run_gpu("--only", "suites", "--workload", "w")
        self.assertEqual(p.returncode, 2)
        self.assertIn("--workload selects among the jobs of --run ID", p.stdout)
        self.assertEqual(self.gpu_sh("frobnicate").returncode, 2)
        self.assertFalse(os.path.exists(os.path.join(self.out, "gpu-results.tar.gz")))


if __name__ == "__main__":
    unittest.main()
