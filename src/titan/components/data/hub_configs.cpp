#include "titan/components/data/hub_configs.h"

#include "titan/common/error.h"

#include <fnmatch.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <regex>
#include <sstream>

namespace titan::data {
namespace {

// A YAML node of the subset read here.
struct Node {
  enum Kind { kNull, kScalar, kSeq, kMap } kind = kNull;
  std::string scalar;
  std::vector<Node> items;                           // kSeq
  std::vector<std::string> keys;  // kMap, in order, with their values
  std::vector<Node> values;
  void add(std::string key, Node value) {
    keys.push_back(std::move(key));
    values.push_back(std::move(value));
  }
  const Node* get(const std::string& key) const {
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &values[i];
    return nullptr;
  }
};

struct Line {
  int indent;
  std::string text;  // without indentation and comment
  int number;        // 1-based, in README.md
};

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::string unquote(const std::string& s) {
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

// Visits every character of s outside quotes with the number of brackets open before it; returns
// open brackets minus closed ones at the end.
template <class Visit>
int scan_brackets(const std::string& s, Visit visit) {
  int depth = 0;
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == quote) quote = 0;
      continue;
    }
    if (c == '\'' || c == '"') {
      quote = c;
      continue;
    }
    if (c == ']' || c == '}') --depth;
    visit(i, c, depth);
    if (c == '[' || c == '{') ++depth;
  }
  return depth;
}

int bracket_depth(const std::string& s) {
  return scan_brackets(s, [](size_t, char, int) {});
}

class Parser {
 public:
  Parser(std::vector<Line> lines, std::string where) : lines_(std::move(lines)), where_(std::move(where)) {}

  // Nesting deeper than this is an error, not a deeper recursion (a README is untrusted input).
  static constexpr int kMaxDepth = 64;
  struct Deeper {
    Parser& p;
    explicit Deeper(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxDepth) p.fail("nested more than 64 levels deep");
    }
    ~Deeper() { --p.depth_; }
  };

  Node block(int indent) {
    const Deeper deeper(*this);
    if (pos_ >= lines_.size() || lines_[pos_].indent < indent) return {};
    const int at = lines_[pos_].indent;
    return is_item(lines_[pos_].text) ? sequence(at) : mapping(at);
  }
  bool done() const { return pos_ >= lines_.size(); }

 private:
  static bool is_item(const std::string& t) { return t == "-" || t.rfind("- ", 0) == 0; }

  [[noreturn]] void fail(const std::string& what) const {
    const int line = pos_ < lines_.size() ? lines_[pos_].number : (lines_.empty() ? 0 : lines_.back().number);
    throw UserError(detail::concat(where_, ":", line, ": ", what));
  }

  Node sequence(int indent) {
    Node n;
    n.kind = Node::kSeq;
    while (pos_ < lines_.size() && lines_[pos_].indent == indent && is_item(lines_[pos_].text)) {
      Line& l = lines_[pos_];
      const size_t off = l.text.find_first_not_of(' ', 1);
      const std::string rest = off == std::string::npos ? "" : l.text.substr(off);
      if (rest.empty()) {
        ++pos_;
        n.items.push_back(block(indent + 1));
      } else if (key_end(rest) != std::string::npos || is_item(rest)) {
        // "- key: value" (a mapping whose keys line up with this one) or "- - x" (a nested sequence)
        l.indent = indent + static_cast<int>(off);
        l.text = rest;
        n.items.push_back(block(l.indent));
      } else {
        ++pos_;
        n.items.push_back(value(rest, indent));
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
      const std::string v = trim(t.substr(colon + 1));
      ++pos_;
      if (!v.empty()) {
        n.add(key, value(v, indent));
      } else if (pos_ < lines_.size() && lines_[pos_].indent > indent) {
        n.add(key, block(lines_[pos_].indent));
      } else if (pos_ < lines_.size() && lines_[pos_].indent == indent && is_item(lines_[pos_].text)) {
        n.add(key, sequence(indent));  // a sequence at its key's indentation
      } else {
        n.add(key, Node{});
      }
    }
    if (pos_ < lines_.size() && lines_[pos_].indent > indent) fail("unexpected indentation");
    return n;
  }

  // A value after "key:" or "- " (the line already consumed): a block scalar takes the deeper lines
  // after it; a flow collection open at the end of the line takes the lines that close it.
  Node value(std::string v, int indent) {
    if (v[0] == '|' || v[0] == '>') {
      std::string text;
      while (pos_ < lines_.size() && lines_[pos_].indent > indent) text += lines_[pos_++].text + "\n";
      Node n;
      n.kind = Node::kScalar;
      n.scalar = text;
      return n;
    }
    while (bracket_depth(v) > 0 && pos_ < lines_.size()) v += " " + lines_[pos_++].text;
    return flow(v);
  }

  Node flow(const std::string& v) {
    const Deeper deeper(*this);
    Node n;
    const bool seq = v.size() >= 2 && v.front() == '[' && v.back() == ']';
    const bool map = v.size() >= 2 && v.front() == '{' && v.back() == '}';
    if (seq || map) {
      n.kind = seq ? Node::kSeq : Node::kMap;
      // The items: split at the commas outside nested brackets and quotes.
      const std::string inner = v.substr(1, v.size() - 2);
      std::vector<std::string> parts;
      size_t from = 0;
      scan_brackets(inner, [&](size_t i, char c, int depth) {
        if (c != ',' || depth != 0) return;
        parts.push_back(trim(inner.substr(from, i - from)));
        from = i + 1;
      });
      if (!trim(inner.substr(from)).empty()) parts.push_back(trim(inner.substr(from)));
      for (const auto& part : parts) {
        if (seq) {
          n.items.push_back(flow(part));
          continue;
        }
        const size_t colon = key_end(part);
        if (colon == std::string::npos) fail("unreadable flow mapping entry '" + part + "'");
        n.add(unquote(trim(part.substr(0, colon))), flow(trim(part.substr(colon + 1))));
      }
      return n;
    }
    if (!v.empty() && (v.front() == '&' || v.front() == '*' || v.front() == '!'))
      fail("unsupported YAML value '" + v + "' (anchors, aliases and tags)");
    n.kind = Node::kScalar;
    n.scalar = unquote(v);
    return n;
  }

 public:
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

 private:
  std::vector<Line> lines_;
  std::string where_;
  size_t pos_ = 0;
  int depth_ = 0;
};

// Text without a trailing comment (a '#' at the start or after a space, outside quotes).
std::string strip_comment(const std::string& s) {
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == quote) quote = 0;
    } else if ((c == '\'' || c == '"') && (i == 0 || s[i - 1] == ' ' || s[i - 1] == '-' || s[i - 1] == '[' ||
                                           s[i - 1] == ',' || s[i - 1] == '{')) {
      quote = c;
    } else if (c == '#' && (i == 0 || s[i - 1] == ' ' || s[i - 1] == '\t')) {
      return s.substr(0, i);
    }
  }
  return s;
}

std::vector<std::string> patterns_of(const Node& n) {
  if (n.kind == Node::kScalar) return {n.scalar};
  std::vector<std::string> out;
  if (n.kind == Node::kSeq)
    for (const auto& item : n.items)
      if (item.kind == Node::kScalar) out.push_back(item.scalar);
  if (out.empty()) throw UserError("a data_files path is neither a pattern nor a list of patterns");
  return out;
}

bool yaml_true(const std::string& s) {
  std::string l = s;
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  return l == "true" || l == "yes" || l == "on" || l == "y" || l == "1";
}

// One entry of configs: its lines parsed alone, so that an entry titan cannot read is that entry's
// problem only.
HubConfig read_entry(const std::vector<Line>& lines, const std::string& where) {
  HubConfig h;
  // The name and the default mark as found in the text, for an entry the parser cannot read: a
  // quoted name whole, a plain one up to a blank, comma or bracket.
  std::smatch m;
  static const std::regex name_re(
      R"re(['"]?config_name['"]?\s*:\s*(?:'([^']*)'|"([^"]*)"|([^'"\s,\[\]{}#][^'"\s,\]}#]*)))re");
  static const std::regex default_re(R"re((^|[\s{,])['"]?default['"]?\s*:\s*['"]?(true|yes|on|y|1)['"]?\s*([,}#]|$))re",
                                     std::regex::icase);
  for (const auto& l : lines)
    if (std::regex_search(l.text, m, name_re)) {
      h.name = trim(m[1].matched ? m[1].str() : m[2].matched ? m[2].str() : m[3].str());
      break;
    }
  h.is_default = std::any_of(lines.begin(), lines.end(), [](const Line& l) { return std::regex_search(l.text, default_re); });
  // How messages name the entry: by its name where one is found before the entry is parsed.
  const std::string shown = h.name.empty() ? "a configuration" : "configuration '" + h.name + "'";
  if (h.name.empty()) h.name = "default";
  try {
    Parser p(lines, where);
    const Node seq = p.block(lines.front().indent);
    if (seq.kind != Node::kSeq || seq.items.size() != 1 || seq.items[0].kind != Node::kMap)
      throw UserError("not a mapping");
    const Node& c = seq.items[0];
    if (const Node* name = c.get("config_name")) {
      if (name->kind != Node::kScalar || trim(name->scalar).empty())
        throw UserError("its config_name is empty or not a plain name: name it");
      h.name = name->scalar;
    }
    const Node* def = c.get("default");
    h.is_default = def && def->kind == Node::kScalar && yaml_true(def->scalar);
    const Node* files = c.get("data_files");
    const Node* dir = c.get("data_dir");
    if (files == nullptr || files->kind == Node::kNull) {
      if (dir && dir->kind == Node::kScalar && !dir->scalar.empty()) h.data_dir = dir->scalar;
      else h.infers_files = true;  // load_dataset finds its files by its own rules
      return h;
    }
    if (files->kind == Node::kSeq && !files->items.empty() && files->items.front().kind == Node::kMap) {
      for (const Node& s : files->items) {
        const Node* split = s.get("split");
        const Node* path = s.get("path");
        if (!split || split->kind != Node::kScalar || !path) throw UserError("a data_files entry without split and path");
        for (auto& pat : patterns_of(*path)) h.files[split->scalar].push_back(pat);
      }
    } else if (files->kind == Node::kMap) {  // {train: pattern(s), test: ...}
      for (size_t i = 0; i < files->keys.size(); ++i)
        for (auto& pat : patterns_of(files->values[i])) h.files[files->keys[i]].push_back(pat);
    } else {
      h.files["train"] = patterns_of(*files);
    }
  } catch (const UserError& e) {
    // The parser's errors name the file and line: the line only, after the entry's.
    std::string what = e.what();
    if (what.rfind(where + ":", 0) == 0) what = "line " + what.substr(where.size() + 1);
    h.problem = detail::concat(where, ":", lines.front().number, ": ", shown, ": ", what);
    h.files.clear();
  }
  return h;
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
  int number = 0;
  bool opened = false;
  while (std::getline(in, line)) {  // the front matter opens with "---", blank lines before it allowed
    ++number;
    if (trim(line).empty()) continue;
    opened = trim(line) == "---";
    break;
  }
  if (!opened) return {};
  // The front matter's "configs:" block: from that top-level key to the next top-level key.
  std::vector<Line> block;
  bool inside = false;
  while (std::getline(in, line)) {
    ++number;
    if (trim(line) == "---" || trim(line) == "...") break;
    const std::string text = strip_comment(line);
    if (trim(text).empty()) continue;
    const int indent = static_cast<int>(text.find_first_not_of(' '));
    const bool top_key = indent == 0 && text[0] != '-';
    if (top_key) inside = trim(text) == "configs:";
    if (inside && !top_key) block.push_back({indent, trim(text), number});
  }
  if (block.empty()) return {};
  // Entries: the lines from one "-" at the list's indentation to the next.
  const int list_indent = block.front().indent;
  TITAN_USER_CHECK(block.front().text[0] == '-', readme_path, ":", block.front().number,
                   ": the front matter's configs is not a list of configurations");
  std::vector<HubConfig> out;
  std::vector<Line> entry;
  for (const Line& l : block) {
    if (l.indent < list_indent) break;
    if (l.indent == list_indent && l.text[0] == '-' && !entry.empty()) {
      out.push_back(read_entry(entry, readme_path));
      entry.clear();
    }
    entry.push_back(l);
  }
  if (!entry.empty()) out.push_back(read_entry(entry, readme_path));
  return out;
}

}  // namespace titan::data
