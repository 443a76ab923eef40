// `titan launch` arguments: parsing, validation, help, and the command's entry point.
#include "titan/launch/launcher.h"

#include "titan/common/error.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <iostream>

namespace titan::dist {

// ---------------------------------------------------------------------------------------------------
// Options

namespace {

int parse_count(const std::string& opt, const std::string& v, int lo) {
  errno = 0;
  char* end = nullptr;
  const long n = v.empty() ? 0 : std::strtol(v.c_str(), &end, 10);
  TITAN_USER_CHECK(!v.empty() && *end == '\0' && errno == 0, opt, " takes a whole number, got '", v, "'",
                   v.find(':') != std::string::npos ? " (elastic ranges like 1:4 are not supported: give a fixed count)"
                                                    : "");
  TITAN_USER_CHECK(n >= lo && n <= 65535, opt, " must be between ", lo, " and 65535, got ", n);
  return static_cast<int>(n);
}

double parse_seconds(const std::string& opt, const std::string& v) {
  char* end = nullptr;
  const double s = v.empty() ? -1 : std::strtod(v.c_str(), &end);
  TITAN_USER_CHECK(!v.empty() && *end == '\0' && s > 0 && s < 1e9, opt, " takes a positive number of seconds, got '",
                   v, "'");
  return s;
}

std::vector<int> parse_rank_list(const std::string& what, const std::string& v) {
  std::vector<int> ranks;
  if (v == "all") return ranks;  // no filter
  size_t start = 0;
  while (start <= v.size()) {
    size_t comma = v.find(',', start);
    if (comma == std::string::npos) comma = v.size();
    const std::string item = v.substr(start, comma - start);
    char* end = nullptr;
    const long r = item.empty() ? -1 : std::strtol(item.c_str(), &end, 10);
    TITAN_USER_CHECK(!item.empty() && *end == '\0' && r >= 0 && r < INT_MAX, what, " is a comma-separated list of "
                     "local ranks like 0,1 (or all); '", item, "' is not a rank");
    ranks.push_back(static_cast<int>(r));
    start = comma + 1;
  }
  return ranks;
}

const char* kValueOptions[] = {"--nproc-per-node", "--nnodes",          "--node-rank",       "--master-addr",
                               "--master-port",    "--local-ranks-filter", "--timeout-seconds", "--grace-seconds",
                               "--max-restarts", "--preemption-grace-seconds", "--log-dir", "--tee", "--redirects",
                               "--role", "--rdzv-id", "--rdzv-backend", "--rdzv-endpoint"};

// torchrun's --tee / --redirects: 0 none, 1 stdout, 2 stderr, 3 both (one value for every rank).
int parse_streams(const std::string& opt, const std::string& v) {
  TITAN_USER_CHECK(v == "0" || v == "1" || v == "2" || v == "3", opt, " takes 0 (none), 1 (stdout), 2 (stderr) or 3 "
                   "(both), got '", v, "'", v.find(':') != std::string::npos ? " (a value per local rank is not "
                   "supported: give one for every rank)" : "");
  return v[0] - '0';
}

}  // namespace

std::string launch_help() {
  return "usage: titan launch --nproc-per-node N [options] -- COMMAND [ARGS...]\n"
         "Starts N workers on this node, each running `titan COMMAND ARGS...` (e.g. train --job.config_file F)\n"
         "with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT set.\n"
         "options (torchrun's spellings with underscores are accepted too):\n"
         "  --nproc-per-node N        workers on this node, usually its number of GPUs (required)\n"
         "  --nnodes M                nodes in the job (default 1); run one launcher per node\n"
         "  --node-rank K             this node's index, 0..M-1 (default with --nnodes 1: 0; with more nodes:\n"
         "                            assigned at the rendezvous, node 0 being the launcher on the host of\n"
         "                            --master-addr/--rdzv-endpoint, which hosts the store)\n"
         "  --master-addr A           host of node 0, reachable from every node (default 127.0.0.1)\n"
         "  --master-port P           free TCP port on node 0 (default 29500; 0: any free port, one node only)\n"
         "  --standalone              one node on localhost with a free port\n"
         "  --local-ranks-filter L    show the output of these local ranks only, e.g. 0 or 0,3, or all\n"
         "                            (default: env LOG_RANK, else all)\n"
         "  --timeout-seconds S       after S seconds, send the workers SIGTERM (they save a checkpoint and stop,\n"
         "                            see job.preemption_signals) and exit 124 (default: no limit)\n"
         "  --grace-seconds G         after a worker failed, wait G seconds after stopping the others (SIGINT)\n"
         "                            before SIGKILL (default 5)\n"
         "  --preemption-grace-seconds P\n"
         "                            after SIGTERM or SIGUSR1 to the launcher (forwarded to the workers,\n"
         "                            which save a checkpoint and exit 75) or the timeout, wait up to P seconds\n"
         "                            before SIGKILL (default 120); a second signal kills the workers at once\n"
         "  --rdzv-endpoint HOST[:PORT]  torchrun's spelling of --master-addr/--master-port (port default 29400).\n"
         "                            --rdzv-backend c10d|static (static: every node gives --node-rank) and\n"
         "                            --rdzv-id ID (the workers' TORCHELASTIC_RUN_ID) are accepted\n"
         "  --role NAME               the workers' ROLE_NAME (default \"default\")\n"
         "  --log-dir DIR             also write each worker's stdout and stderr (every line, shown or not) to\n"
         "                            DIR/<rdzv id>_<unique>/attempt_<n>/<local rank>/stdout.log and stderr.log\n"
         "  --tee S, --redirects S    the streams written to those files (0 none, 1 stdout, 2 stderr, 3 both; under\n"
         "                            $TMPDIR without --log-dir); redirected streams are not shown on the console\n"
         "  --max-restarts N          after a failure, restart all workers up to N times (default 0); a training\n"
         "                            job resumes from its latest complete checkpoint (checkpoint.enable = true).\n"
         "                            With several nodes, give every launcher the same N\n"
         "When a worker fails, the launcher prints its error (once for ranks that fail alike) or last lines,\n"
         "stops the others and, with no restart left, exits non-zero. Workers that stop for preemption (exit\n"
         "code 75) are not a failure: the launcher waits for all of them, restarts nothing and exits 75. A job\n"
         "that stopped itself (exit code 65) or whose ranks refused to start together (78) is not restarted.\n";
}

LaunchOptions parse_launch_options(const std::vector<std::string>& args) {
  LaunchOptions o;
  bool standalone = false, has_filter = false, has_addr = false, has_port = false, has_node_rank = false;
  bool has_tee = false, has_redirects = false;
  std::string rdzv_endpoint, rdzv_backend = "c10d";
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      o.command.assign(args.begin() + i + 1, args.end());
      break;
    }
    if (a.empty() || a[0] != '-') {  // torchrun style: the command starts at the first non-option
      o.command.assign(args.begin() + i, args.end());
      break;
    }
    const size_t eq = a.find('=');
    std::string name = a.substr(0, eq);
    std::replace(name.begin(), name.end(), '_', '-');
    if (name == "--standalone") {
      TITAN_USER_CHECK(eq == std::string::npos, "--standalone takes no value");
      standalone = true;
      continue;
    }
    const bool known = std::find(std::begin(kValueOptions), std::end(kValueOptions), name) != std::end(kValueOptions);
    TITAN_USER_CHECK(known, "unknown option '", a, "'.",
                     name == "--no-python" ? " It is not needed: the workers always run titan itself."
                     : name.rfind("--rdzv", 0) == 0 ? " Rendezvous: --rdzv-endpoint HOST:PORT, --rdzv-backend "
                                                      "c10d|static and --rdzv-id are accepted."
                                                    : "",
                     " Options come before `--`, the titan command after it; see `titan launch --help`.");
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else {
      TITAN_USER_CHECK(i + 1 < args.size() && args[i + 1] != "--", name, " needs a value");
      value = args[++i];
    }
    if (name == "--nproc-per-node") {
      TITAN_USER_CHECK(value != "gpu" && value != "auto" && value != "cpu", "--nproc-per-node takes a number (the "
                       "GPUs of this node to use); '", value, "' is not supported");
      o.nproc_per_node = parse_count(name, value, 1);
    } else if (name == "--nnodes") {
      o.nnodes = parse_count(name, value, 1);
    } else if (name == "--node-rank") {
      o.node_rank = parse_count(name, value, 0);
      has_node_rank = true;
    } else if (name == "--log-dir") {
      TITAN_USER_CHECK(!value.empty(), "--log-dir is empty: give the folder of the workers' log files");
      o.log_dir = value;
    } else if (name == "--tee") {
      o.tee_streams = parse_streams(name, value);
      has_tee = true;
    } else if (name == "--redirects") {
      o.redirect_streams = parse_streams(name, value);
      has_redirects = true;
    } else if (name == "--role") {
      TITAN_USER_CHECK(!value.empty(), "--role is empty");
      o.role = value;
    } else if (name == "--rdzv-id") {
      TITAN_USER_CHECK(!value.empty() && value.find('/') == std::string::npos, "--rdzv-id '", value,
                       "' must be a non-empty name without '/' (it names the workers' log folder)");
      o.run_id = value;
    } else if (name == "--rdzv-backend") {
      TITAN_USER_CHECK(value == "c10d" || value == "static", "--rdzv-backend ", value, " is not supported: titan "
                       "launch rendezvouses through a TCP store on node 0 (c10d or static); etcd is not supported");
      rdzv_backend = value;
    } else if (name == "--rdzv-endpoint") {
      TITAN_USER_CHECK(!value.empty(), "--rdzv-endpoint is empty: give HOST:PORT of node 0");
      rdzv_endpoint = value;
    } else if (name == "--master-addr") {
      TITAN_USER_CHECK(!value.empty(), "--master-addr is empty: give the host of node 0");
      o.master_addr = value;
      has_addr = true;
    } else if (name == "--master-port") {
      o.master_port = parse_count(name, value, 0);
      has_port = true;
    } else if (name == "--local-ranks-filter") {
      o.local_ranks_filter = parse_rank_list(name, value);
      has_filter = true;
    } else if (name == "--timeout-seconds") {
      o.timeout_seconds = parse_seconds(name, value);
    } else if (name == "--grace-seconds") {
      o.grace_seconds = parse_seconds(name, value);
    } else if (name == "--preemption-grace-seconds") {
      o.preemption_grace_seconds = parse_seconds(name, value);
    } else if (name == "--max-restarts") {
      o.max_restarts = parse_count(name, value, 0);
    }
  }
  if (!rdzv_endpoint.empty()) {
    // HOST[:PORT] (torchrun's c10d default port 29400), [IPv6]:PORT: node 0's store, where every node meets.
    std::string host = rdzv_endpoint, port = "29400";
    const size_t colon = rdzv_endpoint.rfind(':');
    const size_t bracket = rdzv_endpoint.rfind(']');
    if (colon != std::string::npos && (bracket == std::string::npos || colon > bracket)) {
      host = rdzv_endpoint.substr(0, colon);
      port = rdzv_endpoint.substr(colon + 1);
    }
    if (host.size() > 1 && host.front() == '[' && host.back() == ']')
      host = host.substr(1, host.size() - 2);
    else
      TITAN_USER_CHECK(host.find(':') == std::string::npos, "--rdzv-endpoint ", rdzv_endpoint, ": write an IPv6 "
                       "address in brackets, [ADDRESS]:PORT");
    TITAN_USER_CHECK(!host.empty(), "--rdzv-endpoint ", rdzv_endpoint, " names no host: give HOST:PORT of node 0");
    const int rdzv_port = parse_count("--rdzv-endpoint's port", port, 0);
    TITAN_USER_CHECK((!has_addr || o.master_addr == host) && (!has_port || o.master_port == rdzv_port),
                     "--rdzv-endpoint ", rdzv_endpoint, " and --master-addr/--master-port name different places to "
                     "meet: give one of them");
    o.master_addr = host;
    o.master_port = rdzv_port;
    has_addr = has_port = true;
    const bool localhost = host == "localhost" || host == "127.0.0.1" || host == "::1";
    TITAN_USER_CHECK(rdzv_port != 0 || (o.nnodes == 1 && localhost), "--rdzv-endpoint ", rdzv_endpoint,
                     ": port 0 (any free port) works for one node on localhost only");
  }
  // Without --node-rank the nodes are numbered at the rendezvous (torchrun's c10d backend): the
  // launcher on the meeting host is node 0 and hosts the store, the others take 1..M-1 as they join.
  if (o.nnodes > 1 && !has_node_rank) {
    TITAN_USER_CHECK(rdzv_backend != "static", "--rdzv-backend static with --nnodes ", o.nnodes, " needs --node-rank K "
                     "on each node (under SLURM, --node-rank $SLURM_NODEID); or use --rdzv-backend c10d, which "
                     "numbers the nodes as they join");
    o.node_rank = -1;
  }
  // Files: the streams --tee and --redirects name (under a temporary folder without --log-dir, as
  // torchrun's); --log-dir alone: both streams.
  o.log_streams = has_tee || has_redirects ? o.tee_streams | o.redirect_streams : o.log_dir.empty() ? 0 : 3;

  if (!has_filter)
    if (const char* log_rank = std::getenv("LOG_RANK"); log_rank && *log_rank)
      o.local_ranks_filter = parse_rank_list("LOG_RANK", log_rank);

  TITAN_USER_CHECK(o.nproc_per_node > 0, "titan launch needs --nproc-per-node N (the number of workers on this "
                   "node, usually its GPUs); see `titan launch --help`");
  if (standalone) {
    TITAN_USER_CHECK(o.nnodes == 1 && !has_addr && !has_port, "--standalone runs one node on localhost with a free "
                     "port; drop --nnodes/--master-addr/--master-port/--rdzv-endpoint, or drop --standalone");
    o.master_port = 0;
  }
  TITAN_USER_CHECK(o.node_rank < o.nnodes, "--node-rank ", o.node_rank, " is not below --nnodes ", o.nnodes,
                   ": nodes are numbered 0..", o.nnodes - 1);
  TITAN_USER_CHECK(has_addr || o.nnodes == 1, "--nnodes ", o.nnodes, " needs --master-addr: the host of node 0, "
                   "reachable from every node (the default 127.0.0.1 reaches only this node, and the other nodes "
                   "would wait for it until the timeout); under SLURM, the first host of the job's node list");
  TITAN_USER_CHECK(o.master_port != 0 || o.nnodes == 1, "--master-port 0 (any free port) works on one node only: "
                   "with --nnodes ", o.nnodes, " every node must be given the same port");
  for (int r : o.local_ranks_filter)
    TITAN_USER_CHECK(r < o.nproc_per_node, has_filter ? "--local-ranks-filter" : "LOG_RANK", " names local rank ", r,
                     " but there are only ", o.nproc_per_node, " workers per node (local ranks 0..",
                     o.nproc_per_node - 1, ")");
  TITAN_USER_CHECK(!o.command.empty(), "nothing to launch: give the titan command after `--`, e.g. "
                   "`titan launch --nproc-per-node 2 -- train --job.config_file F`");
  const std::string& first = o.command.front();
  TITAN_USER_CHECK(first.find('/') == std::string::npos && first != "titan" && first[0] != '-',
                   "after `--` comes a titan command such as `train ...`, not '", first,
                   "': the workers always run this titan binary");
  return o;
}

int run_launcher(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "debug-worker") return run_debug_worker({args.begin() + 1, args.end()});
  for (size_t i = 0; i < args.size(); ++i) {  // --help among the launcher's options (not the worker's)
    const std::string& a = args[i];
    if (a == "--" || a.empty() || a[0] != '-') break;
    if (a == "--help" || a == "-h") {
      std::cout << launch_help();
      return 0;
    }
    std::string name = a.substr(0, a.find('='));
    std::replace(name.begin(), name.end(), '_', '-');
    if (a.find('=') == std::string::npos &&
        std::find(std::begin(kValueOptions), std::end(kValueOptions), name) != std::end(kValueOptions))
      ++i;  // skip its value
  }
  return launch_workers(parse_launch_options(args));
}

}  // namespace titan::dist
