// harness/cli/run_checks.cpp — what `moelab run` checks before any work, and how it writes
// its files (see run_common.hpp): agreement across ranks, the output files (resolved,
// tested, locked, staged), the preflight of a cpu/cuda run on a simulated copy of its world,
// and the host memory the machine has.
//
// Exercised through the command line by harness/tests/cli_bad_input_test.sh (exit codes,
// colliding and unwritable outputs, a held lock, a run too large for host memory).
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/cli/run_common.hpp"
#include "harness/comm/world.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/metrics/results.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/sim/cluster.hpp"
#ifdef MOELAB_HAVE_CUDA
#include "harness/backends/cuda/cuda_backend.hpp"
#endif

namespace moelab::cli {

namespace fs = std::filesystem;

std::string shown(const std::string& value) { return json_fields::one_line(value, 160); }

void check_impl_name(const std::string& name) {
  const auto names = impl_names();
  if (std::find(names.begin(), names.end(), name) != names.end()) return;
  throw ConfigError("--impl \"" + shown(name) + "\" is not a known implementation (known: " +
                    (names.empty() ? std::string("none built") : json_fields::join(names)) + ")");
}

// Bad input seen by only some ranks (a workload file missing on one node, say) must stop
// every rank the same way: a rank that went on alone would wait forever in a collective.
// Each rank's error travels with its kind: '2' bad input, '3' out of memory.
void agree_on_errors(Communicator& comm, const std::string& local_error, bool out_of_memory) {
  const std::string mine = local_error.empty() ? std::string() : (out_of_memory ? "3" : "2") + local_error;
  const auto all = comm.all_gather_strings(mine);
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const std::string msg = (r == 0 ? std::string() : "rank " + std::to_string(r) + ": ") + all[r].substr(1);
    if (all[r][0] == '3') throw AgreedOutOfMemory(msg);
    throw ConfigError(msg);
  }
}

// ---- output files -----------------------------------------------------------------------------

namespace {

struct OutputPath {
  const char* flag;
  std::string given;
  fs::path resolved;  // absolute, "." and ".." gone, symlinks of the existing part followed
};

std::vector<OutputPath> output_paths(const RunOptions& opt) {
  std::vector<OutputPath> v;
  const auto add = [&](const char* flag, const std::string& p) {
    if (p.empty()) return;
    std::error_code ec;
    const fs::path abs = fs::absolute(p, ec);
    if (ec) throw ConfigError(std::string(flag) + " " + shown(p) + ": " + ec.message());
    fs::path r = fs::weakly_canonical(abs, ec);
    if (ec) r = abs.lexically_normal();
    v.push_back({flag, p, r});
  };
  add("--out", opt.out);
  add("--trace", opt.trace);
  add("--record-routing", opt.record_routing);
  return v;
}

// The folder a file goes to, or the part of it that exists when the rest is made at the end
// (results/ in a fresh checkout).
fs::path nearest_existing_folder(const fs::path& file) {
  std::error_code ec;
  fs::path p = file.parent_path();
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  return p;
}

std::string errno_text(int err) { return std::strerror(err); }

// "<dir>/.<name>.<pid>.<random>": unique among runs on every host sharing the folder.
std::string unique_name(const fs::path& dir, const std::string& name, const char* what) {
  static std::atomic<unsigned> counter{0};
  std::random_device rd;
  std::ostringstream s;
  s << '.' << name << '.' << what << '.' << ::getpid() << '.' << std::hex << rd() << '.' << counter++;
  return (dir / s.str()).string();
}

}  // namespace

void RunOutputs::check(const RunOptions& opt) {
  const auto outs = output_paths(opt);
  for (std::size_t i = 0; i < outs.size(); ++i)
    for (std::size_t j = i + 1; j < outs.size(); ++j)
      if (outs[i].resolved == outs[j].resolved)
        throw ConfigError(std::string(outs[i].flag) + " " + shown(outs[i].given) + " and " + outs[j].flag + " " +
                          shown(outs[j].given) + " name the same file " + shown(outs[i].resolved.string()));
  for (const auto& o : outs) {
    const std::string head = std::string(o.flag) + " " + shown(o.given) + ": ";
    std::error_code ec;
    const fs::file_status st = fs::status(o.resolved, ec);
    if (fs::is_directory(st)) throw ConfigError(head + "is a folder; give a file name");
    // Renaming onto /dev/null (as root) would replace the device: only files are outputs.
    if (fs::exists(st) && !fs::is_regular_file(st)) throw ConfigError(head + "exists and is not a regular file");
    const fs::path folder = nearest_existing_folder(o.resolved);
    if (!fs::is_directory(folder, ec)) throw ConfigError(head + shown(folder.string()) + " is not a folder");
    // Only making a file tells: access(2) says yes to root on /proc and on read-only mounts.
    std::string probe = unique_name(folder, "moelab", "check");
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
      throw ConfigError(head + "cannot create a file in " + shown(folder.string()) + " (" + errno_text(errno) + ")");
    ::close(fd);
    ::unlink(probe.c_str());
  }
}

// ---- cleaning up when the process is stopped by a signal --------------------------------------
// Another rank's failure stops this one with SIGTERM (MPI_Abort: mpirun terminates every rank),
// and a user may press Ctrl-C: the outputs' locks, staged files and new folders would stay
// behind, as no destructor runs. So RunOutputs keeps their paths in a table that a signal
// handler can read (fixed storage; only async-signal-safe calls: unlink, rmdir, sigaction,
// raise), and the handler removes them, then lets the signal take its previous action.
namespace {
constexpr int kMaxCleanup = 64;
constexpr std::size_t kCleanupPathMax = 4096;
struct CleanupEntry {
  char path[kCleanupPathMax];
  bool folder;
};
struct CleanupTable {
  CleanupEntry entries[kMaxCleanup];
  int n = 0;
};
// Two tables: publish() fills the one the handler is not reading, then switches to it.
CleanupTable g_tables[2];
std::atomic<const CleanupTable*> g_cleanup{nullptr};
constexpr int kCleanupSignals[] = {SIGTERM, SIGINT, SIGHUP};
struct sigaction g_previous[std::size(kCleanupSignals)];
bool g_handlers_installed = false;

extern "C" void cleanup_on_signal(int sig) {
  if (const CleanupTable* t = g_cleanup.load())
    for (int i = 0; i < t->n; ++i) {
      if (t->entries[i].folder)
        ::rmdir(t->entries[i].path);  // only when empty
      else
        ::unlink(t->entries[i].path);
    }
  for (std::size_t i = 0; i < std::size(kCleanupSignals); ++i)
    if (kCleanupSignals[i] == sig) ::sigaction(sig, &g_previous[i], nullptr);
  ::raise(sig);  // delivered once the handler returns, with the previous action
}
}  // namespace

void RunOutputs::publish() const {
  CleanupTable& t = g_cleanup.load() == &g_tables[0] ? g_tables[1] : g_tables[0];
  t.n = 0;
  auto add = [&](const std::string& p, bool folder) {
    if (p.empty() || t.n >= kMaxCleanup || p.size() >= kCleanupPathMax) return;
    std::memcpy(t.entries[t.n].path, p.c_str(), p.size() + 1);
    t.entries[t.n].folder = folder;
    ++t.n;
  };
  for (const auto& [tmp, dest] : staged_) {
    add(tmp, false);
    add(write_json_atomic_temp(tmp), false);  // what the write of tmp goes through
  }
  for (const auto& h : locks_) add(h.path, false);
  for (const auto& d : created_) add(d.string(), true);  // deepest first, after the files in them
  g_cleanup.store(&t);
  if (t.n > 0 && !g_handlers_installed) {
    struct sigaction sa {};
    sa.sa_handler = cleanup_on_signal;
    sigemptyset(&sa.sa_mask);
    for (std::size_t i = 0; i < std::size(kCleanupSignals); ++i) {
      // A signal the process was started ignoring (nohup, a background job's SIGINT) stays
      // ignored: the run goes on, and so must its locks.
      ::sigaction(kCleanupSignals[i], nullptr, &g_previous[i]);
      if (g_previous[i].sa_handler != SIG_IGN) ::sigaction(kCleanupSignals[i], &sa, nullptr);
    }
    g_handlers_installed = true;
  }
}

void RunOutputs::lock(const RunOptions& opt) {
  for (const auto& o : output_paths(opt)) {
    const std::string head = std::string(o.flag) + " " + shown(o.given) + ": ";
    const std::string path = o.resolved.string() + ".lock";
    for (int attempt = 0;; ++attempt) {
      // The folders that do not exist yet are made now and removed again if the run fails
      // (bad input leaves nothing behind), deepest first.
      std::error_code ec;
      std::vector<fs::path> missing;
      for (fs::path p = o.resolved.parent_path(); !fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p;
           p = p.parent_path())
        missing.push_back(p);
      fs::create_directories(o.resolved.parent_path(), ec);
      if (ec)
        throw ConfigError(head + "cannot create folder " + shown(o.resolved.parent_path().string()) + " (" +
                          ec.message() + ")");
      created_.insert(created_.end(), missing.begin(), missing.end());
      // Deepest first over all outputs (--out new/r.json --trace new/sub/t.json): a folder's
      // path is longer than its parent's.
      std::stable_sort(created_.begin(), created_.end(), [](const fs::path& a, const fs::path& b) {
        return a.native().size() > b.native().size();
      });
      const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0 && errno == ENOENT && attempt < 8) continue;  // another run's failure removed the folder just now
      if (fd < 0) throw ConfigError(head + "cannot create " + shown(path) + " (" + errno_text(errno) + ")");
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int err = errno;
        char buf[32] = {};
        const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
        ::close(fd);
        std::string pid = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
        pid.erase(std::remove_if(pid.begin(), pid.end(), [](char c) { return c < '0' || c > '9'; }), pid.end());
        if (err != EWOULDBLOCK) throw ConfigError(head + "cannot lock " + shown(path) + " (" + errno_text(err) + ")");
        throw ConfigError(head + "another moelab run (" +
                          (pid.empty() ? std::string("pid unknown") : "pid " + pid) +
                          ") is writing this file; wait for it to end or choose another name (lock " +
                          shown(path) + ")");
      }
      // The previous holder removes the lock file as it ends: a file locked after that
      // removal is no longer the one at `path`, and locking it would exclude nobody.
      struct stat held {}, now {};
      if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &now) == 0 && held.st_ino == now.st_ino &&
          held.st_dev == now.st_dev) {
        const std::string pid = std::to_string(::getpid()) + "\n";
        if (::ftruncate(fd, 0) == 0 && ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
          // The pid is only for the message of a second run; the lock holds without it.
        }
        locks_.push_back({path, fd});
        publish();
        break;
      }
      ::close(fd);
    }
  }
}

void RunOutputs::stage(const std::string& path, const nlohmann::json& j, int indent) {
  const fs::path dest(path);
  const fs::path folder = dest.has_parent_path() ? dest.parent_path() : fs::path(".");
  const std::string tmp = unique_name(folder, dest.filename().string(), "staged");
  staged_.emplace_back(tmp, path);  // first, so that a write failing half-way is still removed
  publish();
  write_json_atomic(tmp, j, indent);
}

void RunOutputs::commit() {
  // The result is staged last and renamed last: once it is there, so is everything else.
  for (auto& [tmp, dest] : staged_) {
    if (::rename(tmp.c_str(), dest.c_str()) != 0)
      throw std::runtime_error("cannot rename " + tmp + " to " + dest + ": " + errno_text(errno));
    tmp.clear();
  }
  staged_.clear();
  created_.clear();  // the folders now hold the run's files
  publish();
}

RunOutputs::~RunOutputs() { abandon(); }

void RunOutputs::abandon() {
  // The signal handler's table is emptied first: once a lock is gone, its path may be another
  // run's new lock.
  const auto staged = std::move(staged_);
  const auto locks = std::move(locks_);
  const auto created = std::move(created_);
  staged_.clear();
  locks_.clear();
  created_.clear();
  publish();
  for (const auto& [tmp, dest] : staged)
    if (!tmp.empty()) ::unlink(tmp.c_str());
  // Removed while still locked: a run waiting on it then finds a new file (see lock()).
  for (const auto& h : locks) {
    ::unlink(h.path.c_str());
    ::close(h.fd);
  }
  for (const auto& d : created) ::rmdir(d.c_str());  // only when empty: another run's files stay
}

void abort_run(int rank, const std::exception& e, RunOutputs* outputs) {
  const bool no_host_memory = dynamic_cast<const std::bad_alloc*>(&e) != nullptr;
  const bool oom = no_host_memory || dynamic_cast<const OutOfMemory*>(&e) != nullptr;
  std::fprintf(stderr, "moelab: error (rank %d): %s\n", rank, no_host_memory ? kBadAllocMessage : e.what());
  std::fflush(stderr);
  if (outputs) outputs->abandon();
  abort_world(oom ? 3 : 1);
}

// ---- the simulated world and the preflight ---------------------------------------------------

int sim_world_size(const sim::ClusterModel& cluster, int ranks) {
  const int n = ranks > 0 ? ranks : cluster.world_size();
  if (n > cluster.world_size())
    throw ConfigError("--ranks " + std::to_string(n) + " exceeds the " + std::to_string(cluster.world_size()) +
                      " GPUs of cluster " + shown(cluster.name));
  return n;
}

namespace {

// One node of `world` GPUs with room for anything: the preflight is about the program's
// checks and its memory, not about time, so no capacity of this machine may stop it (the
// implementation's own budgets then read "unlimited", as on cpu where they are unknown).
sim::ClusterModel preflight_cluster(int world) {
  constexpr double kUnlimited = 1e18;  // bytes; far above what any allocation can reach (limits.hpp)
  sim::ClusterModel m;
  m.name = "preflight";
  m.description = "the world of this run, shapes only (moelab run's preflight)";
  m.gpu = {"preflight", 1e15, 1e15, 1e15, kUnlimited, 1e12, "none: a shapes-only check"};
  m.node.name = "preflight";
  m.node.gpu = m.gpu.name;
  m.node.gpus = world;
  m.node.intra = "nvswitch";
  m.node.nvlink_bw = 1e11;
  m.node.host_memory_bytes = kUnlimited * world;
  m.node.host_copy_bw = 1e10;
  m.nodes = 1;
  m.source = m.gpu.source;
  return m;
}

struct PreflightResult {
  std::string config_error;  // the first ConfigError the program met, "" when none
  std::size_t peak_bytes = 0;  // the most tracked memory (device + pinned host) one rank held; 0 unknown
};

PreflightResult preflight(int world, const std::function<void(Backend&, Communicator&)>& one_step) {
  SimOptions so;
  so.cluster = preflight_cluster(world);
  so.shapes_only = true;
  SimCluster cluster(std::move(so));
  std::vector<std::size_t> peak(static_cast<std::size_t>(world), 0);
  PreflightResult res;
  try {
    cluster.run([&](Backend& b, Communicator& c) {
      one_step(b, c);
      const CategoryBytes per = b.memory().peak_per_category();
      peak[static_cast<std::size_t>(c.rank())] =
          b.memory().peak_device() + per[static_cast<std::size_t>(MemCategory::host_pinned)];
    });
  } catch (const ConfigError& e) {
    res.config_error = e.what();
    return res;
  } catch (const std::exception&) {
    // Anything else (a limit of the simulation, a bug) is for the run itself to meet and
    // report as it happens; the preflight only judges the input and the memory.
    return res;
  }
  res.peak_bytes = *std::max_element(peak.begin(), peak.end());
  return res;
}

std::string gib(double bytes) { return strf("%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0)); }

// An unsigned integer from the start of a file ("max", a missing file: 0).
std::uint64_t read_number(const char* path) {
  std::ifstream f(path);
  std::uint64_t v = 0;
  if (!(f >> v)) return 0;
  return v;
}

}  // namespace

std::uint64_t host_memory_available() {
  std::uint64_t avail = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) {
      avail = std::strtoull(line.c_str() + 13, nullptr, 10) * 1024;  // kB
      break;
    }
  if (avail == 0) {
    const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) avail = static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
  }
  // A container's limit: the kernel kills the process at it, whatever the host has free.
  // cgroup v2 (memory.max, "max" when none), then v1 (a huge number when none).
  for (const auto& [limit_file, usage_file] :
       {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
        std::pair{"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const std::uint64_t limit = read_number(limit_file), used = read_number(usage_file);
    if (limit > 0 && limit < (std::uint64_t{1} << 60)) {
      const std::uint64_t room = limit > used ? limit - used : 0;
      avail = avail == 0 ? room : std::min(avail, room);
      break;
    }
  }
  return avail;
}

sim::Profile read_gemm_path_profile(const std::string& profile_path) {
  sim::Profile p = sim::load_profile(profile_path);
  if (!p.gemm_paths)
    throw ConfigError(shown(profile_path) + ": gemm_paths: missing; --profile on --backend cuda installs the profile's "
                      "GEMM-path table, measured by moelab calibrate --backend cuda");
  return p;
}

void install_gemm_path_table(Backend& b, const sim::Profile& p, const std::string& profile_path) {
  if (p.device != b.device_name())
    throw ConfigError(shown(profile_path) + ": device = \"" + shown(p.device) + "\", but this run's GPU is \"" +
                      shown(b.device_name()) + "\": a GEMM-path table holds for the device it was measured on");
#ifdef MOELAB_HAVE_CUDA
  GemmPathTable t = *p.gemm_paths;
  if (t.source.empty()) t.source = "measured on " + p.device;
  t.source = "profile " + shown(p.name) + ": " + t.source;  // its name: no path of the machine in results
  cuda_set_gemm_path_table(b, std::move(t));
#else
  throw ConfigError("--profile on --backend cuda: this binary was built without CUDA");
#endif
}

void start_run(StartedRun& run, const RunOptions& opt, const std::function<void()>& validate,
               const std::function<std::string(const Backend&)>& unsupported,
               const std::function<void(Backend&, Communicator&)>& one_step) {
  const int rank = world_rank(), world = world_size();
  std::string local_error;
  sim::Profile profile;  // --profile on cuda: its GEMM-path table, read before the device starts
  try {
    if (opt.backend == "cuda" && !opt.profile.empty()) profile = read_gemm_path_profile(opt.profile);
    validate();
    if (rank == 0) RunOutputs::check(opt);
  } catch (const ConfigError& e) {
    if (world == 1) throw;
    local_error = e.what();
  }
  run.backend = make_backend(opt.backend);
  run.backend->set_rank(rank);
#ifdef MOELAB_HAVE_CUDA
  if (opt.gemm_path && is_cuda_backend(*run.backend)) cuda_force_gemm_path(*run.backend, opt.gemm_path);
#endif
  if (local_error.empty() && !opt.profile.empty() && opt.backend == "cuda") {
    try {
      install_gemm_path_table(*run.backend, profile, opt.profile);
    } catch (const ConfigError& e) {
      if (world == 1) throw;
      local_error = e.what();
    }
  }
  if (local_error.empty()) {
    const std::string why = unsupported(*run.backend);
    if (!why.empty() && world == 1) throw Unsupported(why);
    local_error = why;
  }
  run.comm = make_world_communicator(*run.backend);
  if (world > 1) agree_on_errors(*run.comm, local_error);

  // Ranks sharing rank 0's host share its memory.
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  int on_host = 1;
  if (world > 1) {
    const auto hosts = run.comm->all_gather_strings(host);
    on_host = static_cast<int>(std::count(hosts.begin(), hosts.end(), hosts[0]));
  }

  bool out_of_memory = false;
  if (rank == 0) {
    try {
      const PreflightResult p = preflight(world, one_step);
      if (!p.config_error.empty()) throw ConfigError(p.config_error);
      // The cpu backend's device memory is this host's; on cuda the host holds little beside
      // pinned offloads, which the device's own accounting reports.
      const std::uint64_t avail = host_memory_available();
      const double need = static_cast<double>(p.peak_bytes) * on_host;
      if (run.backend->name() == "cpu" && avail > 0 && need > static_cast<double>(avail)) {
        const std::string msg =
            "the run needs about " + gib(static_cast<double>(p.peak_bytes)) +
            " of memory per rank (its tracked peak over one step, measured on a shapes-only simulation of this "
            "world)" +
            (on_host > 1 ? " x " + std::to_string(on_host) + " ranks on this host = " + gib(need) : std::string()) +
            ", more than the " + gib(static_cast<double>(avail)) +
            " this machine has available (MemAvailable, or the container's limit): make the workload smaller or "
            "spread the ranks over more hosts";
        if (world == 1) throw OutOfMemory(msg);
        out_of_memory = true;
        local_error = msg;
      } else {
        run.outputs.lock(opt);
      }
    } catch (const ConfigError& e) {
      if (world == 1) throw;
      local_error = e.what();
    }
  }
  if (world > 1) agree_on_errors(*run.comm, local_error, out_of_memory);
}

}  // namespace moelab::cli
