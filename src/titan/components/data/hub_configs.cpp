#include "titan/components/data/hub_configs.h"

#include "titan/common/error.h"

#include <fnmatch.h>

#include <fstream>
#include <memory>
#include <sstream>

namespace titan::data {
namespace {

// A YAML node of the subset read here.
struct Node {
  enum Kind { kNull, kScalar, kSeq, kMap } kind = kNull;
  std::string scalar;
  std::vector<Node> items;                          // kSeq
  std::vector<std::pair<std::string, Node>> fields;  // kMap, in order
  const Node* get(const std::string& key) const {
    for (const auto& [k, v] : fields)
      if (k == key) return &v;
    return nullptr;
  }
};

struct Line {
  int indent;
  std::string text;  // without indentation and comment
  int number;        // 1-based, in README.md
};

class Parser {
 public:
  Parser(std::vector<Line> lines, std::string where) : lines_(std::move(lines)), where_(std::move(where)) {}

  Node block(int indent) {
    if (pos_ >= lines_.size() || lines_[pos_].indent < indent) return {};
    const int at = lines_[pos_].indent;
    return is_item(lines_[pos_].text) ? sequence(at) : mapping(at);
  }

 private:
  static bool is_item(const std::string& t) { return t == "-" || t.rfind("- ", 0) == 0; }

  [[noreturn]] void fail(const std::string& what) const {
    const int line = pos_ < lines_.size() ? lines_[pos_].number : (lines_.empty() ? 0 : lines_.back().number);
    throw UserError(detail::concat(where_, ":", line, ": ", what,
                                   " in the configs of the front matter: fix the file, or set the dataset path to the "
                                   "folder of the files to read"));
  }

  Node sequence(int indent) {
    Node n;
    n.kind = Node::kSeq;
    while (pos_ < lines_.size() && lines_[pos_].indent == indent && is_item(lines_[pos_].text)) {
      Line& l = lines_[pos_];
      const std::string rest = l.text.size() > 1 ? trim(l.text.substr(2)) : "";
      if (rest.empty()) {
        ++pos_;
        n.items.push_back(block(indent + 1));
      } else if (is_key(rest)) {  // "- key: value": a mapping whose keys line up after the dash
        l.indent = indent + 2;
        l.text = rest;
        n.items.push_back(mapping(indent + 2));
      } else {
        ++pos_;
        n.items.push_back(scalar(rest));
      }
    }
    return n;
  }

  Node mapping(int indent) {
    Node n;
    n.kind = Node::kMap;
    while (pos_ < lines_.size() && lines_[pos_].indent == indent && !is_item(lines_[pos_].text)) {
      const std::string t = lines_[pos_].text;
      const size_t colon = key_end(t);
      if (colon == std::string::npos) fail("expected 'key: value', got '" + t + "'");
      const std::string key = unquote(trim(t.substr(0, colon)));
      const std::string value = trim(t.substr(colon + 1));
      ++pos_;
      if (!value.empty()) {
        n.fields.emplace_back(key, scalar(value));
      } else if (pos_ < lines_.size() && lines_[pos_].indent > indent) {
        n.fields.emplace_back(key, block(lines_[pos_].indent));
      } else if (pos_ < lines_.size() && lines_[pos_].indent == indent && is_item(lines_[pos_].text)) {
        n.fields.emplace_back(key, sequence(indent));  // a sequence at its key's indentation
      } else {
        n.fields.emplace_back(key, Node{});
      }
    }
    if (pos_ < lines_.size() && lines_[pos_].indent > indent) fail("unexpected indentation");
    return n;
  }

  Node scalar(const std::string& v) {
    Node n;
    if (v.size() >= 2 && v.front() == '[' && v.back() == ']') {
      n.kind = Node::kSeq;
      std::string item;
      char quote = 0;
      for (char c : v.substr(1, v.size() - 2)) {
        if (quote) {
          if (c == quote) quote = 0;
          item += c;
        } else if (c == '\'' || c == '"') {
          quote = c;
          item += c;
        } else if (c == ',') {
          n.items.push_back(scalar(trim(item)));
          item.clear();
        } else {
          item += c;
        }
      }
      if (!trim(item).empty()) n.items.push_back(scalar(trim(item)));
      return n;
    }
    if (!v.empty() && (v.front() == '{' || v.front() == '|' || v.front() == '>' || v.front() == '&' || v.front() == '*'))
      fail("unsupported YAML value '" + v + "'");
    n.kind = Node::kScalar;
    n.scalar = unquote(v);
    return n;
  }

  static bool is_key(const std::string& t) { return key_end(t) != std::string::npos; }

  // The colon that ends a mapping key (followed by a space or the end), outside quotes.
  static size_t key_end(const std::string& t) {
    char quote = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      const char c = t[i];
      if (quote) {
        if (c == quote) quote = 0;
      } else if ((c == '\'' || c == '"') && i == 0) {
        quote = c;
      } else if (c == ':' && (i + 1 == t.size() || t[i + 1] == ' ')) {
        return i;
      } else if (c == '[' || c == '{') {
        return std::string::npos;
      }
    }
    return std::string::npos;
  }

 public:
  static std::string trim(const std::string& s) {
    const size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
  }
  static std::string unquote(const std::string& s) {
    if (s.size() >= 2 && s.front() == '"' && s.back() == '"') {
      std::string out;
      for (size_t i = 1; i + 1 < s.size(); ++i) {
        if (s[i] == '\\' && i + 2 < s.size()) ++i;
        out += s[i];
      }
      return out;
    }
    if (s.size() >= 2 && s.front() == '\'' && s.back() == '\'') {
      std::string out;
      for (size_t i = 1; i + 1 < s.size(); ++i) {
        out += s[i];
        if (s[i] == '\'' && s[i + 1] == '\'') ++i;
      }
      return out;
    }
    return s;
  }

 private:
  std::vector<Line> lines_;
  std::string where_;
  size_t pos_ = 0;
};

// Text without a trailing comment (a '#' after a space, outside quotes).
std::string strip_comment(const std::string& s) {
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (c == '#' && (i == 0 || s[i - 1] == ' ' || s[i - 1] == '\t')) {
      return s.substr(0, i);
    }
  }
  return s;
}

std::vector<std::string> patterns_of(const Node& n, const std::string& where) {
  if (n.kind == Node::kScalar) return {n.scalar};
  std::vector<std::string> out;
  if (n.kind == Node::kSeq)
    for (const auto& item : n.items)
      if (item.kind == Node::kScalar) out.push_back(item.scalar);
  TITAN_USER_CHECK(!out.empty(), where, ": a data_files path is neither a pattern nor a list of patterns");
  return out;
}

// fnmatch per segment; "**" takes any number of segments.
bool match_segments(const std::vector<std::string>& pat, size_t i, const std::vector<std::string>& path, size_t j) {
  if (i == pat.size()) return j == path.size();
  if (pat[i] == "**") {
    for (size_t k = j; k <= path.size(); ++k)
      if (match_segments(pat, i + 1, path, k)) return true;
    return false;
  }
  return j < path.size() && fnmatch(pat[i].c_str(), path[j].c_str(), FNM_PERIOD) == 0 &&
         match_segments(pat, i + 1, path, j + 1);
}

std::vector<std::string> segments(const std::string& s) {
  std::vector<std::string> out;
  std::string seg;
  std::istringstream in(s);
  while (std::getline(in, seg, '/'))
    if (!seg.empty() && seg != ".") out.push_back(seg);
  return out;
}

}  // namespace

bool hub_pattern_matches(const std::string& pattern, const std::string& path) {
  return match_segments(segments(pattern), 0, segments(path), 0);
}

std::vector<HubConfig> read_hub_configs(const std::string& readme_path) {
  std::ifstream in(readme_path);
  if (!in) return {};
  std::string line;
  if (!std::getline(in, line) || Parser::trim(line) != "---") return {};
  // The front matter's "configs:" block: from that top-level key to the next top-level key.
  std::vector<Line> block;
  bool inside = false;
  int number = 1;
  while (std::getline(in, line)) {
    ++number;
    if (Parser::trim(line) == "---" || Parser::trim(line) == "...") break;
    const std::string text = strip_comment(line);
    if (Parser::trim(text).empty()) continue;
    const int indent = static_cast<int>(text.find_first_not_of(' '));
    if (indent == 0 && text[0] != '-') inside = Parser::trim(text) == "configs:";
    if (inside && !(indent == 0 && text[0] != '-')) block.push_back({indent, Parser::trim(text), number});
  }
  if (block.empty()) return {};
  const std::string where = readme_path;
  Parser p(block, where);
  const Node configs = p.block(0);
  TITAN_USER_CHECK(configs.kind == Node::kSeq, where, ": the front matter's configs is not a list of configurations");
  std::vector<HubConfig> out;
  for (const Node& c : configs.items) {
    TITAN_USER_CHECK(c.kind == Node::kMap, where, ": an entry of configs is not a mapping");
    HubConfig h;
    const Node* name = c.get("config_name");
    h.name = name && name->kind == Node::kScalar ? name->scalar : "default";
    const Node* def = c.get("default");
    h.is_default = def && def->kind == Node::kScalar && (def->scalar == "true" || def->scalar == "True");
    const Node* files = c.get("data_files");
    const std::string here = where + " (config '" + h.name + "')";
    TITAN_USER_CHECK(files != nullptr && files->kind != Node::kNull, here, " names no data_files");
    if (files->kind == Node::kSeq && !files->items.empty() && files->items.front().kind == Node::kMap) {
      for (const Node& s : files->items) {
        const Node* split = s.get("split");
        const Node* path = s.get("path");
        TITAN_USER_CHECK(split && split->kind == Node::kScalar && path, here, ": a data_files entry without split and path");
        for (auto& pat : patterns_of(*path, here)) h.files[split->scalar].push_back(pat);
      }
    } else if (files->kind == Node::kMap) {  // {train: pattern(s), test: ...}
      for (const auto& [split, pats] : files->fields)
        for (auto& pat : patterns_of(pats, here)) h.files[split].push_back(pat);
    } else {
      h.files["train"] = patterns_of(*files, here);
    }
    out.push_back(std::move(h));
  }
  return out;
}

}  // namespace titan::data
