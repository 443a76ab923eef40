// Where this process sits in a multi-process job: its rank, the world size, its rank on this node,
// and the rendezvous address (MASTER_ADDR:MASTER_PORT) every rank connects to.
//
// The environment is read from, in this order:
//   1. torchrun's variables (also set by `titan launch`): RANK, WORLD_SIZE, LOCAL_RANK,
//      LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and GROUP_RANK (or NODE_RANK) for the node index;
//   2. SLURM's task variables (one `srun` task per GPU): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
//      SLURM_NTASKS_PER_NODE or SLURM_[STEP_]TASKS_PER_NODE, SLURM_NODEID, and the first host of
//      SLURM_[STEP_|JOB_]NODELIST as the master; MASTER_ADDR / MASTER_PORT override the master;
//   3. otherwise a single process (rank 0 of 1).
// An inconsistent environment is a UserError that says which variable is wrong and what to set.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include <string>
#include <vector>

namespace titan::dist {

struct LaunchEnv {
  int rank = 0;                 // global rank, 0 <= rank < world_size
  int world_size = 1;           // number of processes in the job
  int local_rank = 0;           // rank among the processes of this node (picks the GPU)
  int local_world_size = 1;     // number of processes on this node
  int node_rank = 0;            // index of this node (torchrun's GROUP_RANK, SLURM_NODEID)
  std::string master_addr = "127.0.0.1";  // host of the rendezvous store (rank 0's node)
  int master_port = 29500;                 // its TCP port
  std::string source = "single";          // "torchrun" | "slurm" | "single"
};

// Reads the launch environment of this process (see the top of this file). Throws UserError when the
// variables are partial, not numbers, or inconsistent (rank >= world size, ...).
LaunchEnv launch_env_from_environment();

// The rendezvous store of a multi-process run: rank 0 hosts a TCPStore at master_addr:master_port
// and the others connect, except under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True),
// where the agent hosts it and every worker is a client whose keys are prefixed with the restart
// attempt (/worker/attempt_<TORCHELASTIC_RESTART_COUNT>/), as PyTorch's workers do: after a restart
// no key of the previous attempt (such as NCCL's unique id) is read again.
c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout);

// Waits until every rank of env's world has reached its own call, at most `timeout`: each rank counts
// itself in on the store and the one that completes the count tells the others (two store operations
// per rank, no polling). Throws UserError naming how many ranks came and what to check when some
// did not: a rank that never started, or launch variables (RANK, WORLD_SIZE) left in the environment
// of a process that was not meant to be part of a job. Before counting itself in, each rank checks
// that the job is one world: its WORLD_SIZE is the one the first rank recorded, and no other process
// claimed its rank (launchers given different --nnodes / --nproc-per-node, or the same --node-rank,
// two jobs on one port, a rank started again on the store of an earlier start). A rank that finds
// otherwise records why and wakes the others: every rank ends at once with that message. The start's
// outcome is one store value, so all ranks go on or none (three more store operations per rank).
void wait_for_every_rank(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                         std::chrono::milliseconds timeout);

// One line for logs: "rank 1/8 (local 1/4, node 0) master 10.0.0.1:29500 [torchrun]".
std::string describe(const LaunchEnv& env);

// The CUDA device this process uses among the `visible_devices` (> 0) it sees: LOCAL_RANK when the
// node's processes share its GPUs (torchrun, titan launch, srun with --gpus-per-node), or device 0 when
// exactly one is visible because the scheduler bound one GPU to each task (srun --gpus-per-task=1,
// which sets CUDA_VISIBLE_DEVICES per task: `visible_devices_set`). Throws UserError when LOCAL_RANK
// exceeds the visible devices, and when several processes of the node would share its one GPU (one
// device visible, CUDA_VISIBLE_DEVICES unset): NCCL refuses two ranks on one GPU.
int local_device_index(const LaunchEnv& env, int visible_devices, bool visible_devices_set);

// Expands a SLURM hostlist: "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5. Zero padding of
// a range follows its lower bound; several bracket groups in one name expand as a product
// ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). Throws UserError on malformed lists.
std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist);

// torchtitan's [comm] trace_buf_size, save_traces_folder and save_traces_file_prefix: LibTorch's
// flight recorder keeps the last `entries` collectives of the process (one ring for all its groups;
// 0 turns it off); with entries > 0 and `nccl`, when an NCCL collective times out, NCCL's watchdog
// (in mode TORCH_NCCL_ASYNC_ERROR_HANDLING=3, which leaves it time to) writes them to
// `<folder>/<prefix><rank>` (readable by PyTorch's flight-recorder analyzer; Gloo
// writes no such dump, so on CPU only the buffer is set). Sets the environment LibTorch reads when
// the first process group is made (call it before that) and creates `folder` when it will be written.
// Returns the variables it changed that were already set, as "NAME=old (now new)".
std::vector<std::string> configure_flight_recorder(int64_t entries, const std::string& folder,
                                                   const std::string& prefix, bool nccl);

// Expands SLURM_TASKS_PER_NODE: "4(x2),3" -> 4 4 3 (tasks on each node, in node order).
std::vector<int> expand_slurm_tasks_per_node(const std::string& value);

// The default MASTER_PORT for a SLURM job: 20000 + job id mod 10000, the same on every node of the job,
// different for concurrent jobs, and below Linux's ephemeral port range (32768+).
int slurm_default_master_port(const std::string& job_id);

}  // namespace titan::dist
