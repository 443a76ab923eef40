// The README and docs/ stay true to the program: every option they name exists, every training or
// estimate command in their examples parses and, given its number of processes, lays out, and every
// TOML block is a config file titan reads. (The
// figures they quote are checked where they are produced: docs/memory.md's table by the estimator's
// tests, the README's log line by the log format's.)
#include "titan/config/field.h"
#include "titan/config/job_config.h"
#include "titan/config/legacy.h"
#include "titan/distributed/parallel_dims.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;

struct Doc {
  std::string path;  // relative to the source folder
  std::string text;
};

std::vector<Doc> docs() {
  std::vector<Doc> out;
  auto read = [&](const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    out.push_back({std::filesystem::relative(p, kSource).string(), ss.str()});
  };
  read(std::filesystem::path(kSource) / "README.md");
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(kSource) / "docs"))
    if (e.path().extension() == ".md") read(e.path());
  return out;
}

// Whether section.key is an option titan accepts: a key, an older spelling of one, or a key titan
// refuses with its reason (the docs say so).
bool accepted(const std::string& path) {
  static JobConfig cfg;
  static const std::vector<config::FieldRef> fields = config::fields_of(cfg);
  const size_t dot = path.find('.');
  const std::string section = path.substr(0, dot), key = path.substr(dot + 1);
  if (config::find_field(fields, section, key)) return true;
  if (key.rfind("no_", 0) == 0 && config::find_field(fields, section, key.substr(3))) return true;  // --section.no_key
  return config::find_legacy(section, key) != nullptr || config::unsupported_reason(path) != nullptr;
}

bool is_section(const std::string& name) {
  for (const auto& s : config::sections())
    if (name == s.name) return true;
  return config::is_legacy_section(name);
}

// Names in the docs that look like options and are not, with what they are.
const std::map<std::string, std::string> kNotOptions = {
    {"training.seq", "a key prefix for --help"},
    {"model.embed_tokens", "a Hugging Face tensor name"},
    {"lr_scheduler.last_epoch", "a key of torchtitan's checkpoints (torch.distributed.checkpoint)"},
};

TEST(Docs, EveryOptionTheDocsNameIsOneTitanAccepts) {
  const std::regex dashed(R"(--([a-z_0-9]+\.[a-z_0-9.-]*[a-z_0-9]))");
  const std::regex quoted(R"(`([a-z_0-9]+\.[a-z_0-9.]*[a-z_0-9])[` =])");
  static const std::set<std::string> file_extensions = {"jsonl", "json", "h", "cpp", "toml", "md", "py", "txt",
                                                        "pickle", "safetensors", "model"};
  int checked = 0;
  for (const Doc& doc : docs()) {
    for (const std::regex* re : {&dashed, &quoted}) {
      for (auto it = std::sregex_iterator(doc.text.begin(), doc.text.end(), *re); it != std::sregex_iterator(); ++it) {
        std::string name = (*it)[1];
        std::replace(name.begin(), name.end(), '-', '_');  // --job.config-file is --job.config_file
        const std::string section = name.substr(0, name.find('.'));
        const std::string last = name.substr(name.rfind('.') + 1);
        if (!is_section(section) || file_extensions.count(last) || kNotOptions.count(name)) continue;
        ++checked;
        EXPECT_TRUE(accepted(name)) << doc.path << " names '" << name << "', which is not an option of titan";
      }
    }
  }
  EXPECT_GT(checked, 190) << "the docs name options in these forms";
}

// The commands of the docs' code blocks that train or estimate: `titan train|estimate ARGS`, `titan
// launch ... -- train ARGS`, torchrun/srun ... titan train ARGS, and `[CONFIG_FILE=..] [NGPU=N]
// ./run_train.sh ARGS`; continued lines joined, comments dropped. Elided examples ("...") are skipped.
struct Command {
  std::string where;
  std::vector<std::string> args;  // the options of `titan train` / `titan estimate`
  int64_t world_size = 0;         // 0: not stated
};

std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::string word;
  char quote = 0;
  bool in_word = false;
  for (char c : line) {
    if (quote) {
      if (c == quote) quote = 0;
      else word += c;
    } else if (c == '"' || c == '\'') {
      quote = c;
      in_word = true;
    } else if (c == ' ' || c == '\t') {
      if (in_word) words.push_back(word);
      word.clear();
      in_word = false;
    } else {
      word += c;
      in_word = true;
    }
  }
  if (in_word) words.push_back(word);
  return words;
}

std::vector<Command> doc_commands() {
  std::vector<Command> out;
  for (const Doc& doc : docs()) {
    std::istringstream in(doc.text);
    bool in_block = false;
    std::string line, joined;
    int number = 0, first = 0;
    while (std::getline(in, line)) {
      ++number;
      if (line.rfind("```", 0) == 0) {
        in_block = !in_block;
        continue;
      }
      if (!in_block) continue;
      if (joined.empty()) first = number;
      const size_t hash = line.find(" #");
      if (hash != std::string::npos) line.erase(hash);
      while (!line.empty() && line.back() == ' ') line.pop_back();
      if (!line.empty() && line.back() == '\\') {
        joined += line.substr(0, line.size() - 1) + " ";
        continue;
      }
      joined += line;
      std::vector<std::string> w = split_words(joined);
      joined.clear();
      if (w.empty()) continue;
      Command c;
      c.where = doc.path + ":" + std::to_string(first);
      std::string config = "configs/llama3_debugmodel.toml";
      bool run_train = false, estimate = false;
      size_t i = 0, args_from = 0;
      for (; i < w.size(); ++i) {
        const std::string& word = w[i];
        if (word.rfind("CONFIG_FILE=", 0) == 0) config = word.substr(12);
        if (word.rfind("NGPU=", 0) == 0) c.world_size = std::stoll(word.substr(5));
        if (word.rfind("--nproc_per_node=", 0) == 0) c.world_size = std::stoll(word.substr(17));
        if (word == "--nproc-per-node" && i + 1 < w.size()) c.world_size = std::stoll(w[i + 1]);
        const bool titan = word == "titan" || (word.size() > 6 && word.compare(word.size() - 6, 6, "/titan") == 0);
        if (word.size() >= 12 && word.compare(word.size() - 12, 12, "run_train.sh") == 0) {
          run_train = true;
          args_from = i + 1;
          break;
        }
        if (titan && i + 1 < w.size() && (w[i + 1] == "train" || w[i + 1] == "estimate")) {
          estimate = w[i + 1] == "estimate";
          args_from = i + 2;
          break;
        }
        if (titan && i + 1 < w.size() && w[i + 1] == "launch") {
          size_t j = i + 2;
          for (; j < w.size() && w[j] != "train"; ++j)
            if (w[j] == "--nproc-per-node" && j + 1 < w.size()) c.world_size = std::stoll(w[j + 1]);
          if (j == w.size()) break;
          args_from = j + 1;
          break;
        }
      }
      if (args_from == 0) continue;
      bool elided = false;
      for (size_t j = args_from; j < w.size(); ++j) {
        // "...", "[config]", or a placeholder such as "CP" for a value: an example's form, not a command
        if (w[j] == "..." || w[j] == "…" || w[j] == "[config]" ||
            std::regex_match(w[j], std::regex("[A-Z][A-Z_]*")))
          elided = true;
        if (estimate && (w[j] == "--world-size" || w[j] == "--device" || w[j] == "--device-memory-gib") &&
            j + 1 < w.size()) {
          if (w[j] == "--world-size") c.world_size = std::stoll(w[j + 1]);
          ++j;
          continue;
        }
        if (w[j] == "--job.config_file" && j + 1 < w.size()) {
          c.args.push_back(w[j]);
          c.args.push_back(kSource + "/" + w[++j]);
          continue;
        }
        c.args.push_back(w[j]);
      }
      if (elided) continue;
      if (run_train) {
        c.args.insert(c.args.begin(), {"--job.config_file", kSource + "/" + config});
        if (c.world_size == 0) c.world_size = 1;  // NGPU's default
      }
      // (`titan estimate` without --world-size takes the fewest ranks the degrees need: not checked)
      out.push_back(std::move(c));
    }
  }
  return out;
}

TEST(Docs, EveryTrainingCommandInTheDocsParsesAndLaysOut) {
  const std::vector<Command> commands = doc_commands();
  int laid_out = 0;
  for (const Command& c : commands) {
    std::string shown;
    for (const auto& a : c.args) shown += " " + a;
    try {
      const JobConfig cfg = parse_config(c.args);
      if (c.world_size > 0) {
        const auto& p = cfg.parallelism;
        (void)dist::ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                                 p.context_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree,
                                 c.world_size, p.expert_parallel_degree);
        ++laid_out;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << c.where << ": the command's options (" << shown << ") on " << c.world_size
                    << " processes: " << e.what();
    }
  }
  EXPECT_GE(commands.size(), 35u) << "the docs show this many training and estimate commands";
  EXPECT_GE(laid_out, 25) << "of them with a stated number of processes";
}

// Every TOML block of the docs (```toml) is a config file titan reads: its sections and keys exist and
// its values have their types.
TEST(Docs, EveryTomlBlockInTheDocsIsAConfigTitanReads) {
  int blocks = 0;
  for (const Doc& doc : docs()) {
    std::istringstream in(doc.text);
    std::string line, block;
    int number = 0, first = 0;
    bool in_toml = false;
    while (std::getline(in, line)) {
      ++number;
      if (!in_toml && line.rfind("```toml", 0) == 0) {
        in_toml = true;
        first = number;
        block.clear();
        continue;
      }
      if (!in_toml) continue;
      if (line.rfind("```", 0) != 0) {
        block += line + "\n";
        continue;
      }
      in_toml = false;
      ++blocks;
      const std::filesystem::path file =
          std::filesystem::temp_directory_path() / ("titan_docs_block_" + std::to_string(::getpid()) + ".toml");
      std::ofstream(file) << block;
      try {
        (void)parse_config({"--job.config_file", file.string()});
      } catch (const std::exception& e) {
        ADD_FAILURE() << doc.path << ":" << first << ": the TOML block is not a config titan reads: " << e.what()
                      << "\n" << block;
      }
      std::filesystem::remove(file);
    }
  }
  EXPECT_GE(blocks, 4) << "the docs show this many TOML blocks";
}

}  // namespace
}  // namespace titan
