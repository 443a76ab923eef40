// `titan launch`: starts the workers of one node, like torchrun.
//
//   titan launch --nproc-per-node N [--nnodes M [--node-rank K] --master-addr A --master-port P]
//                [--standalone] [--local-ranks-filter 0,1] [--timeout-seconds S] [--grace-seconds G]
//                [--max-restarts N]
//                -- train --job.config_file F ...
//
// Each worker is this same binary run with the arguments after `--` and torchrun's environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, ROLE_RANK, MASTER_ADDR,
// MASTER_PORT), read back by launch_env_from_environment() (runtime.h). Every output line of a worker
// is printed whole with a "[rank R]: " prefix, optionally only for some local ranks (LOG_RANK).
// When a worker fails, the launcher names it, prints its error (once for ranks whose errors are
// alike) or its last lines, stops the others (SIGINT, then SIGKILL after the grace period), reaps
// everything and, with --max-restarts N, starts all workers
// again (TORCHELASTIC_RESTART_COUNT = 1, 2, ...; a training job resumes from its latest checkpoint)
// up to N times, else exits non-zero. Node 0's launcher hosts the rendezvous store (torchrun's agent
// store, TORCHELASTIC_USE_AGENT_STORE=True); with several nodes, the launchers restart together
// through it. A preemption signal to the launcher (SIGTERM, SIGUSR1) is forwarded to the
// workers, which finish their step, save and exit with kExitPreempted; the launcher waits for them
// (--preemption-grace-seconds), restarts nothing and exits with that code. See docs/launch.md and
// docs/reliability.md.
#pragma once

#include <string>
#include <vector>

namespace titan::dist {

struct LaunchOptions {
  int nproc_per_node = 0;                  // workers on this node (required)
  int nnodes = 1;                          // nodes in the job
  // This node's index, 0 <= node_rank < nnodes; -1 (several nodes, no --node-rank): assigned at the
  // rendezvous (launch_workers: the launcher on master_addr's host is node 0 and hosts the store, the
  // others number themselves 1.. in the order they reach it, as torchrun's c10d rendezvous does).
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";   // host of rank 0 (node 0)
  int master_port = 29500;                 // 0: pick a free port (single node only)
  std::vector<int> local_ranks_filter;     // local ranks whose output is shown; empty: all
  double timeout_seconds = 0;              // wall-clock limit for the whole job; 0: none
  double grace_seconds = 5;                // SIGINT -> SIGKILL delay when stopping workers after a failure
  // After a preemption signal (SIGTERM, SIGUSR1) forwarded to the workers, or the timeout's
  // SIGTERM: how long they have to save and exit before SIGKILL.
  double preemption_grace_seconds = 120;
  int max_restarts = 0;                    // times all workers are restarted after a failure
  // torchrun's per-rank log files: the streams in log_streams (1 stdout, 2 stderr, 3 both) of each
  // worker, every line, shown on the console or not, also go to
  // <log_dir>/<run_id>_<unique>/attempt_<n>/<local_rank>/stdout.log and stderr.log (a folder of its own
  // per launcher; log_dir empty: under $TMPDIR). log_streams 0: no files.
  std::string log_dir;
  int log_streams = 0;
  int tee_streams = 0;                     // --tee: to the files and the console
  int redirect_streams = 0;                // --redirects: to the files only (unless also teed)
  std::string role = "default";            // ROLE_NAME of the workers (torchrun's --role)
  std::string run_id = "none";             // TORCHELASTIC_RUN_ID of the workers (torchrun's --rdzv-id)
  std::vector<std::string> command;        // the titan command each worker runs, e.g. {"train", ...}
};

// Parses the arguments of `titan launch` (after "launch"); LOG_RANK in the environment sets the
// filter when --local-ranks-filter is absent. Throws UserError on bad or missing arguments.
LaunchOptions parse_launch_options(const std::vector<std::string>& args);

// Starts the workers of `opts`, relays their output, supervises them, and returns the exit code of the
// launcher: 0 when every worker exited 0 (in the last attempt); the failed worker's exit code (128 +
// signal when killed) when no restart is left or when it is kExitStopped or kExitLaunchRefused (not
// restarted), 1 when another node's worker failed; kExitPreempted
// when the workers stopped for preemption (all of them exited with it); else 128 + signal when the
// launcher itself was interrupted; 124 when --timeout-seconds ran out.
int launch_workers(const LaunchOptions& opts);

// Entry point of `titan launch ARGS` (help, options, then launch_workers). Also runs the diagnostic
// `titan launch debug-worker ...`, the stand-in worker of the launcher's tests (see docs/launch.md).
int run_launcher(const std::vector<std::string>& args);

// The usage text of `titan launch --help`.
std::string launch_help();

// The diagnostic worker: prints its environment, pid and lines, sleeps, then exits with a given code
// or raises a signal on a chosen rank. Not a user command; it exists to test the launcher.
int run_debug_worker(const std::vector<std::string>& args);

// Whether `host` names this machine: localhost, a loopback address, its host name (whole), or an
// address of one of its interfaces; what decides, without --node-rank, which launcher hosts the
// rendezvous store (torchrun's c10d rendezvous asks the same).
bool names_this_machine(const std::string& host);

}  // namespace titan::dist
