// `titan launch`: starting the workers, relaying their output, and stopping them on failure,
// signal or timeout (see launcher.h for the contract).
#include "titan/launch/launcher.h"

#include "titan/common/error.h"
#include "titan/common/preemption.h"
#include "titan/common/progress_text.h"
#include "titan/distributed/process_group.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <array>
#include <deque>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <map>
#include <thread>

extern char** environ;

namespace titan::dist {

// ---------------------------------------------------------------------------------------------------
// Supervision

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kTailLines = 20;         // lines of a failed worker repeated in the report
constexpr size_t kMaxLineBytes = 1 << 16;  // a longer line without '\n' is emitted in pieces

int g_signal_pipe[2] = {-1, -1};  // the signal handler writes the signal number here

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] auto n = write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the reader went away; the workers keep running
    off += static_cast<size_t>(n);
  }
}

// Rank 0's progress line (ProgressLine's report mode), drawn on the launcher's terminal: erased
// before any other line is written and drawn again after it.
bool g_progress_enabled = false;  // stderr is a terminal
std::string g_progress_text;      // what is drawn now ("" when nothing)

void erase_progress() {
  if (!g_progress_text.empty()) write_all(2, "\r\033[K");
}
void redraw_progress() {
  if (!g_progress_text.empty()) write_all(2, "\r\033[K" + g_progress_text);
}

// A relayed line or a message of the launcher: never in the middle of the progress line.
void write_line(int fd, const std::string& text) {
  erase_progress();
  write_all(fd, text);
  redraw_progress();
}

void say(const std::string& msg) { write_line(2, "titan launch: " + msg + "\n"); }

// The first line of the error a titan command prints when it fails: "titan train: error: ...",
// "titan train: error from LibTorch: ...".
bool is_error_line(const std::string& line) {
  if (line.rfind("titan ", 0) != 0) return false;
  const size_t colon = line.find(':', 6);  // after the command's name, which has no space
  return colon != std::string::npos && line.find(' ', 6) > colon && line.compare(colon, 7, ": error") == 0;
}

struct Stream {
  int fd = -1;        // read end of the worker's pipe; -1 once at EOF
  int out_fd = 1;     // where its lines go: the launcher's stdout or stderr
  std::string partial;
  std::shared_ptr<std::FILE> log;  // --log-dir: every line also goes here (null: no file)
  bool console = true;             // false: --redirects keeps this stream off the console
};

struct Worker {
  int local_rank = 0, rank = 0;
  pid_t pid = -1;          // also its process group id; kept until reaped so the id cannot be reused
  bool shown = true;       // passes the local-ranks filter
  bool exited = false, reaped = false;
  int exit_status = 0;     // once exited: its exit code, or
  int term_signal = 0;     // the signal that killed it (0: none)
  bool killed_here = false;  // the launcher sent it SIGKILL
  Stream streams[2];
  std::deque<std::string> tail;  // its last lines, shown or not
  // The error titan printed before exiting ("titan train: error: ..." to the end of its output): held
  // back from the stream and said in the launcher's report, once for the ranks that fail alike.
  std::string error;
  bool error_said = false;
  std::chrono::steady_clock::time_point error_since{};

  void emit(const std::string& line, const Stream& s) {
    const int out_fd = s.out_fd;
    if (line.rfind(kProgressReportPrefix, 0) != 0 && s.log) {
      std::fwrite(line.data(), 1, line.size(), s.log.get());
      std::fputc('\n', s.log.get());
      std::fflush(s.log.get());  // a file others may follow (tail -f), and nothing lost if the launcher dies
    }
    if (g_progress_enabled && line.rfind(kProgressReportPrefix, 0) == 0) {
      long long step = 0, total = 0;
      double eta = -1;
      if (std::sscanf(line.c_str() + std::strlen(kProgressReportPrefix), "%lld %lld %lf", &step, &total,
                      &eta) == 3) {
        g_progress_text = progress_text(step, total, eta);
        redraw_progress();
      }
      return;
    }
    const std::string prefixed = "[rank " + std::to_string(rank) + "]: " + line;
    if (!error_said && (!error.empty() || is_error_line(line))) {
      if (error.empty()) error_since = std::chrono::steady_clock::now();
      error += line + "\n";
    } else if (shown && s.console) {
      write_line(out_fd, prefixed + "\n");
    }
    tail.push_back(prefixed);
    if (tail.size() > kTailLines) tail.pop_front();
  }

  // Reads what is available on stream `s` (non-blocking) and emits the complete lines.
  void pump(Stream& s) {
    char buf[65536];
    while (s.fd >= 0) {
      const ssize_t n = read(s.fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return;  // EAGAIN: nothing more now
      if (n == 0) {       // EOF: the worker (and its children) closed the pipe
        close(s.fd);
        s.fd = -1;
        break;
      }
      s.partial.append(buf, static_cast<size_t>(n));
      size_t start = 0, nl;
      while ((nl = s.partial.find('\n', start)) != std::string::npos) {
        emit(s.partial.substr(start, nl - start), s);
        start = nl + 1;
      }
      s.partial.erase(0, start);
      if (s.partial.size() > kMaxLineBytes) {
        emit(s.partial, s);
        s.partial.clear();
      }
    }
  }

  void pump_all() {
    for (auto& s : streams) pump(s);
  }
  void flush_partial() {
    for (auto& s : streams) {
      if (!s.partial.empty()) emit(s.partial, s);
      s.partial.clear();
    }
  }
  bool failed() const { return exited && (term_signal != 0 || exit_status != 0); }
  std::string how() const {
    if (!exited) return "reports";
    if (!failed()) return "exited with code 0 after";
    if (term_signal == SIGKILL && !killed_here)  // no process of titan's sends it
      return "failed: killed by SIGKILL (not sent by titan launch: most often the kernel's out-of-memory killer or a "
             "memory limit of the job; `dmesg` or the scheduler's log says which)";
    return term_signal ? "failed: killed by " + signal_display_name(term_signal)
                       : "failed with exit code " + std::to_string(exit_status);
  }
  int exit_code() const { return term_signal ? 128 + term_signal : exit_status; }
};

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  TITAN_USER_CHECK(n > 0, "cannot find the titan binary through /proc/self/exe: ", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

// The environment of one worker: ours, with the launch variables replaced.
std::vector<std::string> worker_environment(const std::map<std::string, std::string>& set) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (!set.count(kv.substr(0, kv.find('=')))) env.push_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

// Forks one worker in its own process group with stdout/stderr on pipes, dying with the launcher.
void spawn(Worker& w, const std::string& exe, std::vector<std::string> argv, std::vector<std::string> env) {
  int out[2], err[2];
  TITAN_USER_CHECK(pipe2(out, O_CLOEXEC) == 0 && pipe2(err, O_CLOEXEC) == 0, "cannot create pipes: ",
                   std::strerror(errno));
  const int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  std::vector<char*> cargv, cenv;  // built before fork: the child may only make async-signal-safe calls
  for (auto& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  for (auto& s : env) cenv.push_back(s.data());
  cenv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  TITAN_USER_CHECK(pid >= 0, "cannot start worker ", w.rank, ": fork failed: ", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);                          // own group: stopping the worker stops its children too
    prctl(PR_SET_PDEATHSIG, SIGKILL);       // the launcher died: die with it
    if (getppid() != parent) _exit(1);      // ... even if it died before prctl
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGCHLD, SIGPIPE}) sigaction(sig, &dfl, nullptr);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    execve(exe.c_str(), cargv.data(), cenv.data());
    const char msg[] = "titan launch: cannot exec the worker binary\n";
    [[maybe_unused]] auto n = write(2, msg, sizeof msg - 1);
    _exit(127);
  }
  setpgid(pid, pid);  // also here, so the group exists before we might signal it
  if (devnull >= 0) close(devnull);
  close(out[1]);
  close(err[1]);
  w.pid = pid;
  w.streams[0] = Stream{out[0], 1, {}, {}, true};
  w.streams[1] = Stream{err[0], 2, {}, {}, true};
  for (int fd : {out[0], err[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

std::string rank_list(const std::vector<Worker*>& ws) {
  std::string out = ws.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ws.size(); ++i) out += (i ? ", " : "") + std::to_string(ws[i]->rank);
  return out;
}

// Names the failed workers with their exit: a titan error once for all the ranks that printed it
// alike (a config that does not fit the world fails every rank the same way), else each one's last lines.
void report_failures(const std::vector<Worker*>& failed, std::vector<Worker>& all) {
  std::vector<std::vector<Worker*>> groups;  // by (error text, how), in rank order of first appearance
  for (Worker* w : failed) {
    auto said = std::find_if(all.begin(), all.end(), [&](const Worker& o) {
      return o.error_said && !w->error.empty() && o.error == w->error;
    });
    if (said != all.end()) {  // said already for another rank
      say("rank " + std::to_string(w->rank) + " (pid " + std::to_string(w->pid) + ") " + w->how() +
          ", with the same error as rank " + std::to_string(said->rank));
      w->error_said = true;
      continue;
    }
    auto same = std::find_if(groups.begin(), groups.end(), [&](const std::vector<Worker*>& g) {
      return !w->error.empty() && g.front()->error == w->error && g.front()->how() == w->how();
    });
    if (same != groups.end())
      same->push_back(w);
    else
      groups.push_back({w});
  }
  for (const auto& g : groups) {
    Worker& first = *g.front();
    std::string pids;
    for (size_t i = 0; i < g.size(); ++i) pids += (i ? ", " : "") + std::to_string(g[i]->pid);
    if (!first.error.empty()) {
      std::string text;
      for (size_t start = 0; start < first.error.size();) {
        const size_t nl = first.error.find('\n', start);
        text += "  [rank " + std::to_string(first.rank) + "]: " + first.error.substr(start, nl - start) + "\n";
        start = nl + 1;
      }
      say(rank_list(g) + " (pid " + pids + ") " + first.how() + ":");
      write_line(2, text);
      for (Worker* w : g) w->error_said = true;
      continue;
    }
    for (Worker* w : g) {
      say("rank " + std::to_string(w->rank) + " (pid " + std::to_string(w->pid) + ") " + w->how());
      if (!w->tail.empty()) {
        std::string lines;
        for (const auto& l : w->tail) lines += "  " + l + "\n";
        write_line(2, "titan launch: last lines of rank " + std::to_string(w->rank) + ":\n" + lines);
      }
    }
  }
}

void signal_groups(std::vector<Worker>& workers, int sig) {
  for (auto& w : workers)
    if (w.pid > 0 && !w.reaped) {
      kill(-w.pid, sig);  // unreaped: the group id is still ours
      if (sig == SIGKILL) w.killed_here = true;
      if (sig != SIGKILL) kill(-w.pid, SIGCONT);  // a stopped (hung) worker acts on it too
    }
}

}  // namespace

namespace {

// How one attempt of the job ended.
struct Attempt {
  enum Kind { kSucceeded, kFailed, kInterrupted } kind = kSucceeded;
  int code = 0;            // the launcher's exit code if this is the last attempt
  std::string failure;     // kFailed: "rank 1 (node 0) failed: killed by SIGKILL"
};

// Keys of the launchers' coordination in the store node 0's launcher hosts (workers' keys live under
// /worker/attempt_N/).
std::string failure_key(int attempt) { return "/launch/attempt_" + std::to_string(attempt) + "/failure"; }
std::string failures_key(int attempt) { return "/launch/attempt_" + std::to_string(attempt) + "/failures"; }
// How many nodes' workers finished (succeeded, or stopped when preempted): one counter, not a key per
// node, so that asking whether every node is done is one small request whatever the node count.
std::string done_count_key(int attempt) { return "/launch/attempt_" + std::to_string(attempt) + "/done_nodes"; }

// The first launcher to see a failure of attempt `attempt` records it; the others learn it from the store.
void report_failure(c10d::Store* store, int attempt, const std::string& what) {
  if (!store) return;
  try {
    if (store->add(failures_key(attempt), 1) == 1) store->set(failure_key(attempt), std::vector<uint8_t>(what.begin(), what.end()));
  } catch (const std::exception& e) {
    say(std::string("cannot report the failure to the other nodes through the store: ") + e.what());
  }
}

// A failure another node's launcher recorded for this attempt ("" when none; node 0's launcher gone
// before this node finished counts as one).
std::string remote_failure(c10d::Store* store, int attempt) {
  if (!store) return "";
  try {
    if (!store->check({failure_key(attempt)})) return "";
    const auto v = store->get(failure_key(attempt));
    return std::string(v.begin(), v.end());
  } catch (const std::exception& e) {
    return std::string("node 0's launcher, which holds the store, cannot be reached (") + e.what() + ")";
  }
}

// How long a store on this machine has to answer a launcher's connection: one answers within
// milliseconds, so a longer silence means the port is held by something that is not one.
constexpr int kLocalStoreAnswerSeconds = 15;

// Numbers this node at the rendezvous when --node-rank was not given (torchrun's c10d backend): the
// launcher on the meeting host hosts the store and is node 0 (MASTER_ADDR, rank 0's host, stays
// that host); every other launcher connects and takes the next number. Returns the store (the
// host's, or a connection to it).
c10::intrusive_ptr<c10d::Store> join_rendezvous(LaunchOptions& o) {
  const bool ipv6 = o.master_addr.find(':') != std::string::npos;
  const std::string where = (ipv6 ? "[" + o.master_addr + "]" : o.master_addr) + ":" + std::to_string(o.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  std::string bind_error;
  if (names_this_machine(o.master_addr)) {
    try {
      store = make_tcp_store(o.master_addr, static_cast<uint16_t>(o.master_port), /*is_server=*/true,
                             std::chrono::seconds(900));
      o.node_rank = 0;
    } catch (const std::exception& e) {
      // The port is taken: another launcher on this machine hosts the store, or something else
      // holds the port (then connecting fails, and the error says why this launcher did not host).
      bind_error = e.what();
    }
  }
  if (!store) {
    say("waiting for the rendezvous at " + where + " (the launcher on its host numbers the nodes)");
    try {
      if (bind_error.empty()) {
        store = make_tcp_store(o.master_addr, static_cast<uint16_t>(o.master_port), /*is_server=*/false,
                               std::chrono::seconds(900));
      } else {
        // The port is held on this machine: by another launcher's store, which answers at once, or by
        // something else, which LibTorch's client would wait on for 15 minutes whatever its timeout.
        // The connection runs aside; past the deadline the launcher ends (and the thread with it).
        auto pending = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Store>>>();
        auto connected = pending->get_future();
        std::thread([pending, addr = o.master_addr, port = o.master_port] {
          try {
            pending->set_value(make_tcp_store(addr, static_cast<uint16_t>(port), /*is_server=*/false,
                                              std::chrono::seconds(900)));
          } catch (...) {
            pending->set_exception(std::current_exception());
          }
        }).detach();
        if (connected.wait_for(std::chrono::seconds(kLocalStoreAnswerSeconds)) == std::future_status::ready)
          store = connected.get();
      }
    } catch (const std::exception& e) {
      throw UserError(detail::concat(
          "cannot join the rendezvous at ", where, ": ", e.what(),
          bind_error.empty() ? "\nThe launcher on " + o.master_addr + " hosts it and numbers the nodes: start it there"
                             : "\nThis machine is the endpoint's host but could not host the store there (" +
                                   bind_error + "): free the port or choose another",
          "; or give every node --node-rank K"));
    }
    if (!store) {
      // Ended at once: the connecting thread may still be inside LibTorch's client, which must not
      // outlive the process's static destructors.
      const std::string msg = detail::concat(
          "cannot join the rendezvous at ", where, ": this machine is the endpoint's host but could not host the "
          "store there (", bind_error, "), and nothing answered as a rendezvous store within ",
          kLocalStoreAnswerSeconds, " s (a program other than a titan launcher holds the port, or the launcher "
          "that does is stopped): free the port or choose another (--rdzv-endpoint HOST:PORT, --master-port)");
      std::fprintf(stderr, "titan launch: error: %s\n", msg.c_str());
      std::fflush(nullptr);
      _exit(1);
    }
    // (per --rdzv-id: a launcher of another job meeting at the same place does not take a number here)
    const int64_t rank = store->add("/launch/" + o.run_id + "/nodes_joined", 1);
    TITAN_USER_CHECK(rank < o.nnodes, "more launchers than --nnodes ", o.nnodes, " joined the rendezvous at ", where,
                     ": this one would be node ", rank, "; start one launcher per node, or raise --nnodes");
    o.node_rank = static_cast<int>(rank);
  }
  say("node " + std::to_string(o.node_rank) + " of " + std::to_string(o.nnodes) + " (numbered at the rendezvous at " +
      where + (o.node_rank == 0 ? ", which this launcher hosts)" : ")"));
  return store;
}

}  // namespace

bool names_this_machine(const std::string& host) {
  if (host == "localhost") return true;
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof name) == 0) {
    const std::string mine = name;
    if (host == mine || host == mine.substr(0, mine.find('.'))) return true;
  }
  // An address's bytes: IPv4 in the first 4, IPv6 in all 16.
  auto bytes_of = [](const sockaddr* sa) -> std::optional<std::array<unsigned char, 16>> {
    std::array<unsigned char, 16> b{};
    if (sa && sa->sa_family == AF_INET) {
      std::memcpy(b.data(), &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, 4);
      return b;
    }
    if (sa && sa->sa_family == AF_INET6) {
      std::memcpy(b.data(), &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, 16);
      return b;
    }
    return std::nullopt;
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  std::vector<std::pair<int, std::array<unsigned char, 16>>> wanted;
  for (addrinfo* a = found; a; a = a->ai_next) {
    if (a->ai_family == AF_INET && reinterpret_cast<const unsigned char*>(
                                       &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr)[0] == 127) {
      freeaddrinfo(found);
      return true;  // a loopback address
    }
    if (auto b = bytes_of(a->ai_addr)) wanted.emplace_back(a->ai_family, *b);
  }
  freeaddrinfo(found);
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return false;
  bool local = false;
  for (ifaddrs* i = interfaces; i && !local; i = i->ifa_next) {
    const auto b = bytes_of(i->ifa_addr);
    if (!b) continue;
    for (const auto& [family, w] : wanted) local = local || (family == i->ifa_addr->sa_family && w == *b);
  }
  freeifaddrs(interfaces);
  return local;
}

int launch_workers(const LaunchOptions& options) {
  const std::string exe = self_exe();
  LaunchOptions o = options;
  const int world_size = o.nproc_per_node * o.nnodes;

  // The rendezvous store lives in node 0's launcher, as torchrun's agent store does: it outlives
  // workers (a stopped or restarted rank 0 does not take it along), and restarted workers' keys are
  // apart from the previous attempt's (TORCHELASTIC_RESTART_COUNT, see connect_store). The other
  // nodes' launchers connect to it to number themselves (without --node-rank) and to restart
  // together; given their number and no restarts, they do not need it.
  c10::intrusive_ptr<c10d::Store> store;
  if (o.node_rank < 0) store = join_rendezvous(o);
  int port = o.master_port;
  if (store) {
    if (o.node_rank == 0) port = store_port(store);
  } else if (o.node_rank == 0) {
    store = make_tcp_store(o.master_addr, static_cast<uint16_t>(o.master_port), /*is_server=*/true,
                           std::chrono::seconds(900));
    port = store_port(store);
  } else if (o.max_restarts > 0) {
    // Before the signal handlers: until there are workers, SIGTERM or Ctrl-C end the launcher at once.
    store = make_tcp_store(o.master_addr, static_cast<uint16_t>(o.master_port), /*is_server=*/false,
                           std::chrono::seconds(900));
  }
  if (o.nnodes > 1 && o.max_restarts > 0) {
    // Every launcher must restart the same number of times, or one would wait for the others forever.
    const std::string mine = std::to_string(o.max_restarts);
    const auto agreed = store->compareSet("/launch/max_restarts", {}, std::vector<uint8_t>(mine.begin(), mine.end()));
    const std::string theirs(agreed.begin(), agreed.end());
    TITAN_USER_CHECK(theirs == mine, "--max-restarts ", mine, " on node ", o.node_rank, " but ", theirs,
                     " on another node: give every node's launcher the same --max-restarts");
  }

  // The workers' log files: a folder of this launcher's own (torchrun's <log_dir>/<run_id>_<unique>), so
  // that nodes sharing a file system, and runs sharing --log-dir, never write the same file.
  std::string run_log_dir;
  if (o.log_streams != 0) {
    std::filesystem::path base = o.log_dir;
    if (base.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      base = tmp && *tmp ? tmp : "/tmp";
    }
    std::error_code ec;
    std::filesystem::create_directories(base, ec);
    TITAN_USER_CHECK(!ec, "cannot create the folder ", base.string(), " for the workers' log files (--log-dir): ",
                     ec.message());
    std::string name = (base / (o.run_id + "_XXXXXX")).string();
    TITAN_USER_CHECK(mkdtemp(name.data()) != nullptr, "cannot create a folder for the workers' log files under ",
                     base.string(), " (--log-dir): ", std::strerror(errno));
    run_log_dir = name;
    say("the workers' output is also written under " + run_log_dir);
  }

  TITAN_USER_CHECK(pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, "cannot create a pipe: ", std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGCHLD}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::map<std::string, std::string> common = {
      {"WORLD_SIZE", std::to_string(world_size)},      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},     {"NODE_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},                  {"MASTER_PORT", std::to_string(port)},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},        {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
      {"ROLE_NAME", o.role},                           {"TORCHELASTIC_RUN_ID", o.run_id}};
  // On a terminal, the metrics rank reports its progress to the launcher, which draws it.
  g_progress_enabled = isatty(2) == 1;
  common[kProgressReportVariable] = g_progress_enabled ? "1" : "0";  // never inherited from an outer launcher
  // As torchrun does: several CPU-hungry processes on one node would oversubscribe the cores.
  if (o.nproc_per_node > 1 && !std::getenv("OMP_NUM_THREADS")) common["OMP_NUM_THREADS"] = "1";

  const auto start = Clock::now();
  auto seconds = [](double s) { return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); };
  const auto grace = seconds(o.grace_seconds), preemption_grace = seconds(o.preemption_grace_seconds);
  // Other nodes' launchers to agree with on failures and restarts (only when restarts are allowed).
  c10d::Store* coord = o.nnodes > 1 && o.max_restarts > 0 ? store.get() : nullptr;

  auto run_attempt = [&](int attempt) {
    std::vector<Worker> workers(static_cast<size_t>(o.nproc_per_node));
    // torchrun's layout, <run folder>/attempt_<n>/<local_rank>/{stdout,stderr}.log: every file opened
    // (not inherited by the workers) before any worker starts.
    std::vector<std::array<std::shared_ptr<std::FILE>, 2>> logs(static_cast<size_t>(o.nproc_per_node));
    for (int lr = 0; lr < o.nproc_per_node && !run_log_dir.empty(); ++lr) {
      const std::filesystem::path dir =
          std::filesystem::path(run_log_dir) / ("attempt_" + std::to_string(attempt)) / std::to_string(lr);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      TITAN_USER_CHECK(!ec, "cannot create the folder ", dir.string(), " for the workers' log files: ", ec.message());
      for (int k = 0; k < 2; ++k) {
        if (!(o.log_streams & (1 << k))) continue;
        const std::string path = (dir / (k == 0 ? "stdout.log" : "stderr.log")).string();
        logs[lr][k].reset(std::fopen(path.c_str(), "we"), [](std::FILE* f) { if (f) std::fclose(f); });
        TITAN_USER_CHECK(logs[lr][k] != nullptr, "cannot write the worker's log file ", path, ": ",
                         std::strerror(errno));
      }
    }
    for (int lr = 0; lr < o.nproc_per_node; ++lr) {
      Worker& w = workers[lr];
      w.local_rank = lr;
      w.rank = o.node_rank * o.nproc_per_node + lr;
      w.shown = o.local_ranks_filter.empty() || std::count(o.local_ranks_filter.begin(), o.local_ranks_filter.end(), lr);
      auto vars = common;
      vars["RANK"] = vars["ROLE_RANK"] = std::to_string(w.rank);
      vars["LOCAL_RANK"] = std::to_string(lr);
      vars["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
      std::vector<std::string> argv{exe};
      if (o.command.front() == "debug-worker") argv.push_back("launch");  // the diagnostic lives under `launch`
      argv.insert(argv.end(), o.command.begin(), o.command.end());
      spawn(w, exe, argv, worker_environment(vars));
      for (int k = 0; k < 2; ++k) {
        w.streams[k].log = logs[lr][k];
        w.streams[k].console = !((o.redirect_streams & ~o.tee_streams) & (1 << k));  // teed: shown as well
      }
    }

    // The loop: relay output; on the first failure (here or, with several nodes, on another node),
    // signal or timeout, stop everyone (SIGTERM, then SIGKILL after the grace period); end when every
    // worker has exited and, with several nodes, every node's workers succeeded or one failed.
    Attempt outcome;
    bool stopping = false, killed = false, local_done = false;
    Clock::time_point kill_at{}, done_at{};
    // The other nodes' launchers, through the store: asked at most every store_poll (100 ms, longer
    // with many nodes, so that the store answers at most ~2000 such requests a second).
    const auto store_poll = std::chrono::milliseconds(std::clamp(o.nnodes / 2, 100, 1000));
    Clock::time_point next_store_check{};
    bool done_posted = false;
    auto post_done = [&] {
      if (!done_posted) coord->add(done_count_key(attempt), 1);
      done_posted = true;
    };
    // After a failure: SIGINT, which titan does not handle (SIGTERM would ask it to save first, and a
    // job with a failed rank cannot finish its step).
    auto stop = [&](Attempt::Kind kind, int code) {
      stopping = true;
      outcome.kind = kind;
      outcome.code = code;
      kill_at = Clock::now() + grace;
      signal_groups(workers, SIGINT);
    };
    bool preempting = false;  // the workers were asked to save and stop, or began to by themselves
    bool signalled = false;   // the launcher received a signal (first_signal: when)
    Clock::time_point first_signal{};

    while (true) {
      std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
      std::vector<std::pair<Worker*, Stream*>> owners{{nullptr, nullptr}};
      for (auto& w : workers)
        for (auto& s : w.streams)
          if (s.fd >= 0) {
            fds.push_back({s.fd, POLLIN, 0});
            owners.push_back({&w, &s});
          }
      poll(fds.data(), fds.size(), 100);
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) owners[i].first->pump(*owners[i].second);

      unsigned char sig;
      while (read(g_signal_pipe[0], &sig, 1) == 1) {
        if (sig == SIGCHLD) continue;  // only wakes the loop
        const bool preemption = sig == SIGTERM || sig == SIGUSR1;
        const bool repeat = signalled && Clock::now() - first_signal < seconds(kSignalRepeatSeconds);
        if (repeat) continue;  // the same notice, delivered twice (the scheduler signals every process)
        if (!signalled) {
          signalled = true;
          first_signal = Clock::now();
          for (auto& w : workers)  // errors held back so far are said now, before anything may kill us
            if (!w.error.empty() && !w.error_said) {
              std::vector<Worker*> one{&w};
              report_failures(one, workers);
            }
          say("received " + signal_display_name(sig) +
              (preemption ? ", forwarding it to the workers (they save a checkpoint and stop; up to " +
                                format_seconds(o.preemption_grace_seconds) + " s, --preemption-grace-seconds)"
                          : ", stopping the workers"));
          const bool already_preempting = preempting;
          stopping = true;
          preempting = preempting || preemption;
          if (!already_preempting) {
            outcome.kind = Attempt::kInterrupted;
            outcome.code = 128 + sig;
          }
          kill_at = Clock::now() + (preemption ? preemption_grace : grace);
          signal_groups(workers, sig);
        } else if (!killed) {
          say("received " + signal_display_name(sig) + " again, killing the workers");
          killed = true;
          signal_groups(workers, SIGKILL);
        }
      }

      // Exits, detected without reaping (WNOWAIT) so that each pid, and with it the group id, stays ours.
      std::vector<Worker*> failures;
      for (auto& w : workers) {
        if (w.exited) continue;
        siginfo_t info{};
        if (waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0)
          continue;
        w.exited = true;
        (info.si_code == CLD_EXITED ? w.exit_status : w.term_signal) = info.si_status;
        w.pump_all();
        const bool preempted = w.term_signal == 0 && w.exit_status == kExitPreempted;
        if (preempted && !preempting && (!stopping || outcome.kind == Attempt::kInterrupted)) {
          // Not a failure: the ranks agreed to stop after a step and saved it; the others follow.
          say("rank " + std::to_string(w.rank) + " stopped for preemption (exit code " + std::to_string(kExitPreempted) +
              "); waiting for the other workers, restarting nothing");
          preempting = stopping = true;
          outcome.kind = Attempt::kInterrupted;
          outcome.code = kExitPreempted;
          kill_at = Clock::now() + preemption_grace;
        } else if (w.failed() && !stopping) {
          failures.push_back(&w);
        }
      }
      if (!failures.empty()) {
        for (Worker* w : failures) w->flush_partial();
        report_failures(failures, workers);
        const Worker& first = *failures.front();
        outcome.failure = "rank " + std::to_string(first.rank) + " (node " + std::to_string(o.node_rank) + ") " + first.how();
        // A rank refused at the start is not the job's failure to share: a refusal before the start
        // reaches every rank through the start's outcome (each node's workers exit with it), and a
        // process refused after it ends alone while the job goes on.
        if (first.term_signal != 0 || first.exit_status != kExitLaunchRefused) report_failure(coord, attempt, outcome.failure);
        const auto running = std::count_if(workers.begin(), workers.end(), [](const Worker& w) { return !w.exited; });
        if (running > 0) say("stopping the other " + std::to_string(running) + " worker(s)");
        stop(Attempt::kFailed, first.exit_code());
      }
      // An error held back from a worker that has not exited a second later (hung in its teardown) is
      // said now rather than when it ends.
      for (auto& w : workers)
        if (!w.exited && !w.error.empty() && !w.error_said && Clock::now() - w.error_since > std::chrono::seconds(1)) {
          std::vector<Worker*> one{&w};
          report_failures(one, workers);
        }
      if (!stopping && coord && !local_done && Clock::now() >= next_store_check) {
        next_store_check = Clock::now() + store_poll;
        const std::string remote = preempting ? "" : remote_failure(coord, attempt);
        if (!remote.empty()) {
          outcome.failure = remote;
          say("another node reports: " + remote + "; stopping the workers of this node");
          stop(Attempt::kFailed, 1);
        }
      }

      if (!stopping && o.timeout_seconds > 0 &&
          Clock::now() - start > std::chrono::duration<double>(o.timeout_seconds)) {
        char secs[32];
        std::snprintf(secs, sizeof secs, "%g", o.timeout_seconds);
        say(std::string("timeout of ") + secs + " s (--timeout-seconds) reached, stopping the workers (SIGTERM: they "
            "save a checkpoint and stop)");
        stopping = preempting = true;
        outcome.kind = Attempt::kInterrupted;
        outcome.code = 124;
        kill_at = Clock::now() + preemption_grace;
        signal_groups(workers, SIGTERM);
      }
      if (stopping && !killed && Clock::now() >= kill_at) {
        const auto left = std::count_if(workers.begin(), workers.end(), [](const Worker& w) { return !w.exited; });
        if (left > 0) say(std::to_string(left) + " worker(s) still running after the grace period, sending SIGKILL");
        killed = true;
        signal_groups(workers, SIGKILL);
      }
      if (std::all_of(workers.begin(), workers.end(), [](const Worker& w) { return w.exited; })) {
        if (stopping && preempting && coord) {
          // Preempted: node 0's launcher (the store's host) stays until every node's workers stopped, so
          // that no other node mistakes its going for a failure.
          try {
            post_done();
            if (o.node_rank == 0) {
              const auto until = Clock::now() + preemption_grace;
              while (coord->add(done_count_key(attempt), 0) < o.nnodes && Clock::now() < until)
                std::this_thread::sleep_for(store_poll);
            }
          } catch (const std::exception&) {
          }
          break;
        }
        if (stopping || !coord) break;
        // Every worker here succeeded: the attempt is over when every node's did, or one failed.
        if (local_done && Clock::now() < next_store_check) continue;
        next_store_check = Clock::now() + store_poll;
        bool all_done = false;
        std::string remote;
        try {
          if (!local_done) {
            post_done();
            say("the workers of this node finished; waiting for the other nodes");
            done_at = Clock::now();
          }
          local_done = true;
          all_done = coord->add(done_count_key(attempt), 0) >= o.nnodes;
          if (!all_done && coord->check({failure_key(attempt)})) {
            const auto v = coord->get(failure_key(attempt));
            remote.assign(v.begin(), v.end());
          }
        } catch (const std::exception&) {
          all_done = true;  // node 0's launcher is gone: it ends only once every node finished
        }
        if (all_done) break;
        if (remote.empty() && Clock::now() - done_at > std::chrono::seconds(120)) {
          // The workers of a training job end within moments of each other (their last collectives).
          say("the other nodes did not report finishing within 120 s after this node's workers did (does every "
              "launcher have the same --max-restarts?); ending");
          break;
        }
        if (!remote.empty()) {  // another node failed after ours finished: everyone restarts
          outcome.kind = Attempt::kFailed;
          outcome.code = 1;
          outcome.failure = remote;
          say("another node reports: " + remote);
          break;
        }
      }
    }

    // Whatever a worker left in its process group goes now; then reap, so no process outlives the launcher.
    for (auto& w : workers) {
      w.pump_all();  // what is still buffered in the pipes (EAGAIN if a child of the worker holds them open)
      w.flush_partial();
      for (auto& s : w.streams)
        if (s.fd >= 0) close(s.fd);
    }
    signal_groups(workers, SIGKILL);
    for (auto& w : workers) {
      int status;
      while (waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
      }
      w.reaped = true;
    }
    // Errors not yet said (ranks that failed while the others were being stopped), once per error.
    std::vector<Worker*> unsaid;
    for (auto& w : workers)
      if (!w.error.empty() && !w.error_said) unsaid.push_back(&w);
    report_failures(unsaid, workers);
    // A signal forwarded to the workers: the job was preempted when every worker saved and stopped
    // (75), finished when every one ended its run (0, the signal came at the last step); a worker that
    // did neither gives its exit.
    if (outcome.kind == Attempt::kInterrupted && outcome.code != 124 && preempting) {
      auto all_exited_with = [&](int code) {
        return std::all_of(workers.begin(), workers.end(), [&](const Worker& w) { return w.term_signal == 0 && w.exit_status == code; });
      };
      if (all_exited_with(kExitPreempted)) {
        outcome.code = kExitPreempted;
      } else if (all_exited_with(0)) {
        outcome.code = 0;
      } else {
        for (const auto& w : workers)
          if (w.failed() && !(w.term_signal == 0 && w.exit_status == kExitPreempted)) {
            outcome.code = w.exit_code();
            break;
          }
      }
    }
    erase_progress();  // the attempt is over: the terminal is left with whole lines only
    g_progress_text.clear();
    return outcome;
  };

  int result = 0;
  for (int attempt = 0;; ++attempt) {
    const Attempt a = run_attempt(attempt);
    result = a.code;
    if (a.kind != Attempt::kFailed) break;
    // A job that stopped itself, or whose ranks refused to start together, would do the same again: not
    // restarted (the failure of another node included).
    auto ended_with = [&a](int code) {
      return a.code == code || a.failure.find("failed with exit code " + std::to_string(code)) != std::string::npos;
    };
    if (ended_with(kExitStopped)) {
      if (o.max_restarts > 0)
        say("not restarting: the job stopped itself (exit code " + std::to_string(kExitStopped) +
            ", e.g. a non-finite loss under training.nan_policy = stop), and would stop again at the same step");
      break;
    }
    if (ended_with(kExitLaunchRefused)) {
      if (o.max_restarts > 0)
        say("not restarting: the ranks refused to start together (exit code " + std::to_string(kExitLaunchRefused) +
            ": launchers or jobs that disagree, as the error above says), and the same launch would be refused again");
      break;
    }
    if (attempt >= o.max_restarts) {
      if (o.max_restarts > 0) say("no restarts left (--max-restarts " + std::to_string(o.max_restarts) + "); the job failed");
      break;
    }
    say("restarting all workers (restart " + std::to_string(attempt + 1) + " of " + std::to_string(o.max_restarts) +
        ") after " + a.failure + "; a training job resumes from its latest complete checkpoint");
  }
  if (store && o.node_rank == 0 && coord) {
    // The other nodes' launchers may still read the last attempt's keys; give them a moment.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGCHLD}) signal(sig, SIG_DFL);
  close(g_signal_pipe[0]);
  close(g_signal_pipe[1]);
  return result;
}

}  // namespace titan::dist
