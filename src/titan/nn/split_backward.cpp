#include "titan/nn/split_backward.h"

#include <ATen/ATen.h>
// Internal autograd API pinned to the torch version (2.11): graph nodes and edges, pre-hooks on a
// node, the engine's execute with chosen outputs, and gradient accumulators of leaves.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace titan::nn {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// Records the gradients a node receives (its inputs in backward) when it runs.
struct CaptureGrads : torch::autograd::FunctionPreHook {
  std::shared_ptr<variable_list> slot;
  explicit CaptureGrads(std::shared_ptr<variable_list> s) : slot(std::move(s)) {}
  variable_list operator()(const variable_list& grads) override {
    *slot = grads;
    return grads;
  }
};

// Process-wide, not per thread: the autograd engine runs a CUDA graph's nodes on its device thread.
DeferWeights* current_defer = nullptr;

}  // namespace

// Weights whose gradient paths share nodes: the nodes where those paths leave the inputs' (their
// incoming gradients captured during the input pass) and the weights' accumulators.
struct WeightPass::Group {
  std::vector<std::shared_ptr<Node>> starts;
  std::vector<std::shared_ptr<variable_list>> captured;
  torch::autograd::edge_list weights;
};

WeightPass::~WeightPass() = default;

std::unique_ptr<WeightPass> WeightPass::plan(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                             const std::vector<at::Tensor>& weights_in) {
  std::unique_ptr<WeightPass> pass(new WeightPass());
  pass->output_ = output;
  const std::shared_ptr<Node> root = output.grad_fn();
  if (!root) return pass;
  // The graph: every node reachable from the output, and who feeds gradients into whom.
  std::unordered_map<Node*, std::shared_ptr<Node>> owner{{root.get(), root}};
  std::unordered_map<Node*, std::vector<Node*>> parents;
  std::vector<Node*> stack{root.get()};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.function) continue;
      parents[e.function.get()].push_back(n);
      if (owner.emplace(e.function.get(), e.function).second) stack.push_back(e.function.get());
    }
  }
  // The inputs' path: nodes from which an input's gradient is reachable.
  std::unordered_set<Node*> input_path, input_accs;
  for (const auto& in : inputs) {
    const std::shared_ptr<Node> acc = torch::autograd::impl::try_get_grad_accumulator(in);
    if (!acc || !owner.count(acc.get())) continue;
    input_accs.insert(acc.get());
    std::vector<Node*> todo{acc.get()};
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      if (!input_path.insert(n).second) continue;
      for (Node* p : parents[n]) todo.push_back(p);
    }
  }
  // The weights' accumulators: those given, or every leaf's but the inputs'.
  std::vector<std::shared_ptr<Node>> accs;
  if (!weights_in.empty()) {
    for (const auto& w : weights_in) {
      if (!w.requires_grad()) continue;
      const std::shared_ptr<Node> acc = torch::autograd::impl::try_get_grad_accumulator(w);
      if (acc && owner.count(acc.get())) accs.push_back(acc);  // else: not used by this graph
    }
  } else {
    for (const auto& [n, node] : owner)
      if (dynamic_cast<torch::autograd::AccumulateGrad*>(n) && !input_accs.count(n)) accs.push_back(node);
  }
  // Per weight: the nodes of its own path (up from its accumulator, short of the inputs' path) and
  // the input-path nodes where that path starts.
  struct Weight {
    Edge edge;
    std::set<Node*> own, starts;
  };
  std::vector<Weight> weights;
  for (const auto& acc : accs) {
    Weight w;
    w.edge = Edge(acc, 0);
    std::vector<Node*> todo{acc.get()};
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      if (input_path.count(n)) {
        w.starts.insert(n);
        continue;
      }
      if (!w.own.insert(n).second) continue;
      for (Node* parent : parents[n]) todo.push_back(parent);
    }
    if (!w.starts.empty()) weights.push_back(std::move(w));
    // A weight whose path never meets the inputs' (the root itself reads only weights) has no
    // start on it: the weight pass cannot begin from captured gradients.
    else if (w.own.count(root.get())) return nullptr;
  }
  // Groups: weights sharing a node (union-find).
  std::vector<size_t> group(weights.size());
  std::iota(group.begin(), group.end(), 0);
  std::function<size_t(size_t)> find = [&](size_t i) { return group[i] == i ? i : group[i] = find(group[i]); };
  std::unordered_map<Node*, size_t> first_user;
  for (size_t i = 0; i < weights.size(); ++i) {
    for (const auto* set : {&weights[i].own, &weights[i].starts}) {
      for (Node* n : *set) {
        auto [it, fresh] = first_user.emplace(n, i);
        if (!fresh) group[find(i)] = find(it->second);
      }
    }
  }
  std::map<size_t, std::vector<size_t>> members;
  for (size_t i = 0; i < weights.size(); ++i) members[find(i)].push_back(i);
  // A start that reaches another start of its group along the inputs' path would receive that
  // gradient twice in the weight pass (captured, and recomputed through the path).
  for (const auto& [g, list] : members) {
    std::set<Node*> starts;
    for (size_t i : list) starts.insert(weights[i].starts.begin(), weights[i].starts.end());
    if (starts.size() < 2) continue;
    for (Node* s : starts) {
      std::unordered_set<Node*> seen;
      std::vector<Node*> todo;
      for (const Edge& e : s->next_edges())
        if (e.function && input_path.count(e.function.get())) todo.push_back(e.function.get());
      while (!todo.empty()) {
        Node* n = todo.back();
        todo.pop_back();
        if (!seen.insert(n).second) continue;
        if (starts.count(n)) return nullptr;
        for (const Edge& e : n->next_edges())
          if (e.function && input_path.count(e.function.get())) todo.push_back(e.function.get());
      }
    }
  }
  for (const auto& [g, list] : members) {
    auto wg = std::make_unique<Group>();
    std::set<Node*> starts;
    for (size_t i : list) {
      wg->weights.push_back(weights[i].edge);
      starts.insert(weights[i].starts.begin(), weights[i].starts.end());
    }
    for (Node* s : starts) {
      auto slot = std::make_shared<variable_list>();
      s->add_pre_hook(std::make_unique<CaptureGrads>(slot));
      wg->starts.push_back(owner.at(s));
      wg->captured.push_back(slot);
    }
    pass->groups_.push_back(std::move(wg));
  }
  return pass;
}

void WeightPass::run() {
  for (auto& g : groups_) {
    torch::autograd::edge_list roots;
    variable_list grads;
    for (size_t i = 0; i < g->starts.size(); ++i) {
      const variable_list& captured = *g->captured[i];
      for (size_t k = 0; k < captured.size(); ++k) {
        if (!captured[k].defined()) continue;
        roots.emplace_back(g->starts[i], static_cast<uint32_t>(k));
        grads.push_back(captured[k]);
      }
    }
    if (roots.empty()) continue;
    torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                                                           /*accumulate_grad=*/true, g->weights);
  }
  groups_.clear();
  output_.reset();
}

DeferWeights::DeferWeights() : previous_(current_defer) { current_defer = this; }
DeferWeights::~DeferWeights() { current_defer = previous_; }
DeferWeights* DeferWeights::current() { return current_defer; }

}  // namespace titan::nn
