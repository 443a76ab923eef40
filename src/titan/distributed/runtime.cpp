#include "titan/distributed/runtime.h"

#include "titan/common/error.h"
#include "titan/distributed/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cctype>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>

#include <unistd.h>

namespace titan::dist {

namespace {

std::optional<std::string> get_env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

// A whole-string decimal integer in [lo, hi]; `what` names its origin for the message.
int parse_int(const std::string& what, const std::string& value, long lo, long hi) {
  errno = 0;
  char* end = nullptr;
  const long v = value.empty() ? 0 : std::strtol(value.c_str(), &end, 10);
  TITAN_USER_CHECK(!value.empty() && end && *end == '\0' && errno == 0 && !std::isspace(value[0]), what,
                   " is '", value, "', which is not a whole number; set it to an integer");
  TITAN_USER_CHECK(v >= lo && v <= hi, what, " is ", v, ", out of range: it must be between ", lo, " and ", hi);
  return static_cast<int>(v);
}

int env_int(const char* name, long lo, long hi) {
  auto v = get_env(name);
  TITAN_ASSERT(v.has_value(), name);
  return parse_int(name, *v, lo, hi);
}

void check_consistency(const LaunchEnv& e, const std::string& rank_var, const std::string& world_var,
                       const std::string& local_var, const std::string& local_world_var, const std::string& fix) {
  TITAN_USER_CHECK(e.rank < e.world_size, rank_var, "=", e.rank, " is not below ", world_var, "=", e.world_size,
                   ": ranks go from 0 to world size - 1. ", fix);
  TITAN_USER_CHECK(e.local_rank < e.local_world_size, local_var, "=", e.local_rank, " is not below ",
                   local_world_var, "=", e.local_world_size, ": local ranks go from 0 to the processes per node - 1. ",
                   fix);
  TITAN_USER_CHECK(e.local_world_size <= e.world_size, local_world_var, "=", e.local_world_size, " exceeds ",
                   world_var, "=", e.world_size, ": a node cannot hold more processes than the job. ", fix);
}

const char* kTorchrunFix =
    "Start titan with `titan launch --nproc-per-node N -- train ...` or `torchrun --nproc_per_node N --no-python "
    "titan train ...`, which set all of them, or unset them for a single process.";

LaunchEnv from_torchrun() {
  const char* required[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  std::string present, missing;
  for (const char* name : required) (get_env(name) ? present : missing) += std::string(" ") + name;
  TITAN_USER_CHECK(missing.empty(), "the launch environment is partial: found", present, " but not", missing,
                   ". ", kTorchrunFix);
  LaunchEnv e;
  e.source = "torchrun";
  e.world_size = env_int("WORLD_SIZE", 1, INT_MAX);
  e.rank = env_int("RANK", 0, INT_MAX);
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", 1, INT_MAX);
  e.local_rank = env_int("LOCAL_RANK", 0, INT_MAX);
  check_consistency(e, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", kTorchrunFix);
  if (get_env("GROUP_RANK")) e.node_rank = env_int("GROUP_RANK", 0, INT_MAX);
  else if (get_env("NODE_RANK")) e.node_rank = env_int("NODE_RANK", 0, INT_MAX);
  else e.node_rank = e.rank / e.local_world_size;  // nodes hold equal blocks of consecutive ranks

  auto addr = get_env("MASTER_ADDR");
  auto port = get_env("MASTER_PORT");
  // One process needs no rendezvous address; several must agree on one, as torch's env:// requires.
  TITAN_USER_CHECK(e.world_size == 1 || (addr && port), "WORLD_SIZE=", e.world_size, " but ",
                   addr ? "MASTER_PORT" : (port ? "MASTER_ADDR" : "MASTER_ADDR and MASTER_PORT"),
                   " not set: every rank needs the host and port of rank 0's rendezvous store. Set MASTER_ADDR "
                   "(rank 0's host) and MASTER_PORT (a free port there), or ",
                   kTorchrunFix);
  if (addr) {
    TITAN_USER_CHECK(!addr->empty(), "MASTER_ADDR is empty; set it to the host of rank 0");
    e.master_addr = *addr;
  }
  if (port) e.master_port = parse_int("MASTER_PORT", *port, 1, 65535);
  return e;
}

const char* kSlurmFix =
    "Start the tasks with srun (one task per GPU, e.g. `srun --ntasks-per-node=8 titan train ...`) or set "
    "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT yourself.";

LaunchEnv from_slurm() {
  LaunchEnv e;
  e.source = "slurm";
  const char* ntasks_var = get_env("SLURM_NTASKS") ? "SLURM_NTASKS" : "SLURM_NPROCS";
  TITAN_USER_CHECK(get_env(ntasks_var), "SLURM_PROCID is set but neither SLURM_NTASKS nor SLURM_NPROCS: cannot tell "
                   "the world size. ", kSlurmFix);
  TITAN_USER_CHECK(get_env("SLURM_LOCALID"), "SLURM_PROCID is set but SLURM_LOCALID is not. ", kSlurmFix);
  e.world_size = env_int(ntasks_var, 1, INT_MAX);
  e.rank = env_int("SLURM_PROCID", 0, INT_MAX);
  e.local_rank = env_int("SLURM_LOCALID", 0, INT_MAX);
  e.node_rank = get_env("SLURM_NODEID") ? env_int("SLURM_NODEID", 0, INT_MAX) : 0;

  // Tasks on this node: a plain count when the job asked for --ntasks-per-node, else this node's entry
  // of the step's (or job's) compressed per-node list.
  std::string local_world_var = "SLURM_NTASKS_PER_NODE";
  if (get_env("SLURM_NTASKS_PER_NODE")) {
    e.local_world_size = env_int("SLURM_NTASKS_PER_NODE", 1, INT_MAX);
  } else {
    local_world_var = get_env("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
    auto per_node = get_env(local_world_var.c_str());
    TITAN_USER_CHECK(per_node, "SLURM_PROCID is set but none of SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE, "
                     "SLURM_TASKS_PER_NODE is: cannot tell the processes per node. ", kSlurmFix);
    const std::vector<int> counts = expand_slurm_tasks_per_node(*per_node);
    TITAN_USER_CHECK(static_cast<size_t>(e.node_rank) < counts.size(), "SLURM_NODEID=", e.node_rank, " but ",
                     local_world_var, "='", *per_node, "' lists ", counts.size(), " node(s). ", kSlurmFix);
    e.local_world_size = counts[e.node_rank];
  }
  check_consistency(e, "SLURM_PROCID", ntasks_var, "SLURM_LOCALID", local_world_var, kSlurmFix);

  if (auto addr = get_env("MASTER_ADDR"); addr && !addr->empty()) {
    e.master_addr = *addr;
  } else {
    const char* list_var = get_env("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST"
                           : get_env("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST"
                                                           : "SLURM_NODELIST";
    auto list = get_env(list_var);
    TITAN_USER_CHECK(list || e.world_size == 1, "SLURM_PROCID is set but SLURM_JOB_NODELIST is not: cannot find the "
                     "master node. Set MASTER_ADDR to the host of rank 0.");
    if (list) {
      const auto hosts = expand_slurm_hostlist(*list);
      TITAN_USER_CHECK(!hosts.empty(), list_var, " is empty; set MASTER_ADDR to the host of rank 0");
      e.master_addr = hosts.front();
    }
  }
  if (auto port = get_env("MASTER_PORT")) e.master_port = parse_int("MASTER_PORT", *port, 1, 65535);
  else if (auto job = get_env("SLURM_JOB_ID")) e.master_port = slurm_default_master_port(*job);
  return e;
}

}  // namespace

LaunchEnv launch_env_from_environment() {
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})
    if (get_env(name)) return from_torchrun();
  if (get_env("SLURM_PROCID")) return from_slurm();
  return LaunchEnv{};
}

std::string describe(const LaunchEnv& e) {
  return detail::concat("rank ", e.rank, "/", e.world_size, " (local ", e.local_rank, "/", e.local_world_size,
                        ", node ", e.node_rank, ") master ", e.master_addr, ":", e.master_port, " [", e.source, "]");
}

int local_device_index(const LaunchEnv& env, int visible_devices, bool visible_devices_set) {
  TITAN_ASSERT(visible_devices > 0, "local_device_index needs at least one device");
  if (visible_devices == 1) {
    TITAN_USER_CHECK(env.local_world_size == 1 || visible_devices_set, env.local_world_size,
                     " processes run on this node (", describe(env), ") and they all see its one CUDA device: NCCL "
                     "needs a GPU per rank. Start 1 process per node (--nproc-per-node 1), or bind one GPU to each "
                     "process (CUDA_VISIBLE_DEVICES per process, e.g. srun --gpus-per-task=1), or train on the CPU "
                     "(CUDA_VISIBLE_DEVICES= with an empty value)");
    return 0;
  }
  TITAN_USER_CHECK(env.local_rank < visible_devices, "local rank ", env.local_rank, " (", describe(env), ") has no GPU: "
                   "only ", visible_devices, " CUDA devices are visible on this node. Start at most ", visible_devices,
                   " processes per node (--nproc-per-node, --ntasks-per-node) or make more GPUs visible "
                   "(CUDA_VISIBLE_DEVICES)");
  return env.local_rank;
}

namespace {

// Splits at commas outside brackets.
std::vector<std::string> split_top_level(const std::string& s, const std::string& whole) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    TITAN_USER_CHECK(depth == 0 || depth == 1, "malformed SLURM hostlist '", whole, "': unbalanced or nested brackets");
    if (c == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  TITAN_USER_CHECK(depth == 0, "malformed SLURM hostlist '", whole, "': a '[' is not closed");
  parts.push_back(cur);
  return parts;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

// "01-03,7" -> 01 02 03 7
std::vector<std::string> expand_ranges(const std::string& body, const std::string& whole) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    if (comma == std::string::npos) comma = body.size();
    const std::string item = body.substr(start, comma - start);
    const size_t dash = item.find('-');
    const std::string lo = item.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    TITAN_USER_CHECK(all_digits(lo) && all_digits(hi) && lo.size() <= 9 && hi.size() <= 9, "malformed SLURM hostlist '",
                     whole, "': '", item, "' in brackets is not a number or a range like 01-04");
    const long a = std::stol(lo), b = std::stol(hi);
    TITAN_USER_CHECK(a <= b, "malformed SLURM hostlist '", whole, "': range ", item, " goes backwards");
    TITAN_USER_CHECK(b - a < 1000000, "SLURM hostlist '", whole, "': range ", item, " is implausibly large");
    for (long v = a; v <= b; ++v) {
      std::string num = std::to_string(v);
      if (num.size() < lo.size()) num.insert(0, lo.size() - num.size(), '0');
      out.push_back(num);
    }
    start = comma + 1;
  }
  return out;
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist) {
  std::vector<std::string> hosts;
  if (hostlist.empty()) return hosts;
  for (const std::string& part : split_top_level(hostlist, hostlist)) {
    TITAN_USER_CHECK(!part.empty(), "malformed SLURM hostlist '", hostlist, "': empty entry between commas");
    // Product over the bracket groups of this entry, left to right.
    std::vector<std::string> names{""};
    size_t pos = 0;
    while (pos < part.size()) {
      const size_t open = part.find('[', pos);
      const std::string literal = part.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      TITAN_USER_CHECK(literal.find(']') == std::string::npos, "malformed SLURM hostlist '", hostlist,
                       "': ']' without '['");
      for (auto& n : names) n += literal;
      if (open == std::string::npos) break;
      const size_t close = part.find(']', open);
      const auto values = expand_ranges(part.substr(open + 1, close - open - 1), hostlist);
      std::vector<std::string> next;
      next.reserve(names.size() * values.size());
      for (const auto& n : names)
        for (const auto& v : values) next.push_back(n + v);
      names = std::move(next);
      pos = close + 1;
    }
    hosts.insert(hosts.end(), names.begin(), names.end());
  }
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(const std::string& value) {
  std::vector<int> counts;
  size_t start = 0;
  TITAN_USER_CHECK(!value.empty(), "SLURM_TASKS_PER_NODE is empty");
  while (start <= value.size()) {
    size_t comma = value.find(',', start);
    if (comma == std::string::npos) comma = value.size();
    const std::string item = value.substr(start, comma - start);
    const std::string what = "SLURM_TASKS_PER_NODE entry '" + item + "' (of '" + value + "')";
    const size_t paren = item.find('(');
    if (paren == std::string::npos) {
      counts.push_back(parse_int(what, item, 0, INT_MAX));
    } else {
      // "4(x2)": 4 tasks on each of 2 nodes
      TITAN_USER_CHECK(item.size() > paren + 3 && item.compare(paren, 2, "(x") == 0 && item.back() == ')', what,
                       " is malformed: expected a count or COUNT(xREPEAT) like 4(x2)");
      const int count = parse_int(what, item.substr(0, paren), 0, INT_MAX);
      const int repeat = parse_int(what, item.substr(paren + 2, item.size() - paren - 3), 1, 1000000);
      counts.insert(counts.end(), repeat, count);
    }
    start = comma + 1;
  }
  return counts;
}

int slurm_default_master_port(const std::string& job_id) {
  // Array jobs look like "1234_5"; hash every digit so tasks of different array elements differ too.
  unsigned long h = 0;
  for (char c : job_id)
    if (std::isdigit(static_cast<unsigned char>(c))) h = h * 10 + static_cast<unsigned long>(c - '0');
  return 20000 + static_cast<int>(h % 10000);
}

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool under_agent = agent_store && std::string(agent_store) == "True";
  const bool server = env.rank == 0 && !under_agent;
  c10::intrusive_ptr<c10d::Store> store =
      make_tcp_store(env.master_addr, static_cast<uint16_t>(env.master_port), server, timeout);
  if (!under_agent) return store;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::string(attempt && *attempt ? attempt : "0"),
                                                store);
}

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// Why this rank cannot join the job's world ("" when it can). The job is one world only if every
// rank agrees on its size and no rank starts twice: launchers given different --nnodes /
// --nproc-per-node, or two given the same --node-rank, would otherwise wait for each other until the
// timeout, or worse, build a process group of the wrong ranks.
std::string start_problem(c10d::Store& store, const LaunchEnv& env) {
  const std::string again =
      "; or this rank was started again on the store of a start that already ran (every rank of a job starts "
      "once per store: titan launch gives each restart its own keys, torchrun's restart after nodes join or leave "
      "does not, unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)";
  const std::string world = std::to_string(env.world_size);
  if (const std::string theirs = text_of(store.compareSet("titan/world_size", {}, bytes_of(world))); theirs != world) {
    return detail::concat(
        "this rank (", describe(env), ") was started with WORLD_SIZE ", world, " but ranks of the same job with ",
        theirs, ": every launcher of a job must be given the same --nnodes and --nproc-per-node (srun: the same "
        "--ntasks), and jobs sharing a machine need their own MASTER_PORT", again);
  }
  char host[HOST_NAME_MAX + 1] = {};
  if (gethostname(host, sizeof host) != 0) std::snprintf(host, sizeof host, "?");
  // Who claims the rank: host and pid, then a random tag and the pid namespace (processes of one pid
  // in two containers of one host name differ by them).
  std::error_code ec;
  const std::string pid_ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec).string();
  const std::string me = detail::concat(host, " (pid ", getpid(), ")");
  const std::string claim = me + "#" + std::to_string(std::random_device{}()) + "@" + pid_ns;
  const std::string owner_claim = text_of(store.compareSet("titan/rank_" + std::to_string(env.rank), {}, bytes_of(claim)));
  if (owner_claim == claim) return "";
  const auto tag = owner_claim.rfind('#');
  const std::string owner = owner_claim.substr(0, tag);
  const auto at = tag == std::string::npos ? std::string::npos : owner_claim.find('@', tag);
  const bool same_pid_ns = at != std::string::npos && owner_claim.substr(at + 1) == pid_ns && !pid_ns.empty();
  // The same host and pid namespace and a pid that has ended: the rank's earlier process, on a
  // store that outlived it.
  const auto paren = owner.rfind(" (pid ");
  const bool ended_here = same_pid_ns && paren != std::string::npos && owner.substr(0, paren) == host &&
                          kill(static_cast<pid_t>(std::atol(owner.c_str() + paren + 6)), 0) != 0 &&
                          errno == ESRCH;
  return ended_here
             ? detail::concat("rank ", env.rank, " of ", env.world_size, " was started again on the store of a "
                              "start that already ran (its earlier process, ", owner, ", has ended); this is ",
                              me, ". Every rank of a job starts once per store: restart the whole job (titan "
                              "launch --max-restarts gives each restart its own keys; torchrun's restart after "
                              "nodes join or leave reuses them unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
             : detail::concat("rank ", env.rank, " of ", env.world_size, " was started twice: on ", owner,
                              " and on ", me, ". Two launchers were given the same --node-rank (give each "
                              "node its own, 0 to --nnodes - 1, or give none at all and let the rendezvous "
                              "number them), or two jobs share MASTER_ADDR:MASTER_PORT (give each its own "
                              "port)", again);
}

}  // namespace

void wait_for_every_rank(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                         std::chrono::milliseconds timeout) {
  const std::string count_key = "titan/ranks_started", all_key = "titan/every_rank_started",
                    refused_key = "titan/start_refused";
  const std::string problem = start_problem(*store, env);
  // The start's outcome is one write, the first: "ok" by the rank that completes the count, "refused"
  // by a rank that found a problem (recorded before it), or "timed out" by a rank whose wait ran out.
  // Every rank acts on that one value, so no rank goes on into a job that others leave. A refusal
  // would happen again (LaunchRefused: not restarted); a timeout may not (a late node): UserError.
  const std::vector<uint8_t> ok = bytes_of("ok"), refused = bytes_of("refused"), timed_out = bytes_of("timed out");
  if (!problem.empty()) {
    store->compareSet(refused_key, {}, bytes_of(problem));
    store->compareSet(all_key, {}, refused);
    // When the job had already started ("ok"), it goes on without this process (its launcher does not
    // report a refusal to the other nodes).
    throw LaunchRefused(problem);
  }
  if (store->add(count_key, 1) == env.world_size) store->compareSet(all_key, {}, ok);
  const auto start = std::chrono::steady_clock::now();
  try {
    store->wait({all_key}, timeout);
    const std::vector<uint8_t> outcome = store->get(all_key);
    if (outcome != ok) {
      const std::string why = detail::concat("the job cannot start (this is ", describe(env), "): another rank found: ",
                                             text_of(store->get(refused_key)));
      if (outcome == refused) throw LaunchRefused(why);
      throw UserError(why);
    }
  } catch (const c10::Error& e) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    // The timeout is an outcome too: recorded first, so no late rank goes on alone; when the count
    // completed meanwhile ("ok"), the job starts after all.
    try {
      store->compareSet(refused_key, {}, bytes_of("not every rank started within comm.init_timeout_seconds"));
      if (store->compareSet(all_key, {}, timed_out) == ok) return;
    } catch (const c10::Error&) {  // the store is gone: said below
    }
    int64_t started = -1;
    try {
      started = store->add(count_key, 0);
    } catch (const c10::Error&) {  // the store itself is gone (its host ended): the count is unknown
    }
    // Ended well before the timeout, or the store no longer answers: the store went away (its host,
    // rank 0 or the launcher, ended), not a rank that failed to come.
    TITAN_USER_CHECK(started >= 0 && waited >= timeout * 9 / 10, "the rendezvous store at ", env.master_addr, ":",
                     env.master_port, " stopped answering after ", waited.count() / 1000.0,
                     " s while this rank waited for the others to start (", e.what_without_backtrace(),
                     "); this is ", describe(env), ". Its host (rank 0, or the launcher or agent) has probably "
                     "ended: see its log");
    throw UserError(detail::concat(
        started >= 0 ? detail::concat("only ", started, " of ") : std::string("not all of "), env.world_size,
        " ranks started within comm.init_timeout_seconds (", timeout.count() / 1000, " s); this is ", describe(env),
        ". Start every rank of the job (titan launch / torchrun --nnodes and --nproc-per-node, srun --ntasks), all "
        "with the same MASTER_ADDR and MASTER_PORT; a process that is not part of a job must not inherit RANK, "
        "WORLD_SIZE, LOCAL_RANK and MASTER_ADDR from its environment (unset them)"));
  }
}

std::vector<std::string> configure_flight_recorder(int64_t entries, const std::string& folder,
                                                   const std::string& prefix, bool nccl) {
  TITAN_USER_CHECK(entries >= 0, "comm.trace_buf_size must be 0 (off) or positive, got ", entries);
  std::vector<std::string> replaced;
  auto set = [&](const char* name, const std::string& value) {
    const char* old = std::getenv(name);
    if (old && value != old) replaced.push_back(std::string(name) + "=" + old + " (now " + value + ")");
    ::setenv(name, value.c_str(), /*overwrite=*/1);
  };
  set("TORCH_FR_BUFFER_SIZE", std::to_string(entries));
  if (entries == 0 || !nccl) return replaced;
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  TITAN_USER_CHECK(!ec && std::filesystem::is_directory(folder), "cannot create the flight recorder's folder ", folder,
                   " (comm.save_traces_folder under job.dump_folder): ", ec ? ec.message() : "not a folder",
                   "; choose a writable folder, or set comm.trace_buf_size = 0");
  set("TORCH_NCCL_DUMP_ON_TIMEOUT", "1");
  // The watchdog's mode that leaves the dump to be written (1 tears the communicators down first).
  set("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3");
  set("TORCH_FR_DUMP_TEMP_FILE", (std::filesystem::path(folder) / prefix).string());
  return replaced;
}

}  // namespace titan::dist
