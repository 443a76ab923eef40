#include "titan/config/field.h"

#include "titan/common/error.h"
#include "titan/config/suggest.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace titan::config {

namespace {

template <class... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string format_double(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  // The shortest text that reads back exactly, written like Python's repr: positional for
  // exponents in [-4, 16) (0.0008, 1.5), scientific otherwise (1e-08).
  char buf[64];
  auto [sci_end, sci_ec] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  TITAN_ASSERT(sci_ec == std::errc());
  const std::string scientific(buf, sci_end);
  const int exponent = std::stoi(scientific.substr(scientific.find('e') + 1));
  if (exponent < -4 || exponent >= 16) return scientific;
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::fixed);
  TITAN_ASSERT(ec == std::errc());
  std::string s(buf, end);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";  // keep it a TOML float
  return s;
}

template <class T>
std::string format_list(const std::vector<T>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    if constexpr (std::is_same_v<T, std::string>) {
      out += quote(items[i]);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      out += format_list(items[i]);
    } else {
      out += std::to_string(items[i]);
    }
  }
  return out + "]";
}

// A short description of a TOML node for error messages: its type and (abridged) value.
std::string describe(const toml::node& node) {
  std::string text = "...";
  if (node.is_string()) text = quote(node.as_string()->get());
  else if (node.is_integer()) text = std::to_string(node.as_integer()->get());
  else if (node.is_floating_point()) text = format_double(node.as_floating_point()->get());
  else if (node.is_boolean()) text = node.as_boolean()->get() ? "true" : "false";
  else if (node.is_array()) text = "[...]";
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  const char* type = "value";
  switch (node.type()) {
    case toml::node_type::string: type = "a string"; break;
    case toml::node_type::integer: type = "an integer"; break;
    case toml::node_type::floating_point: type = "a float"; break;
    case toml::node_type::boolean: type = "a boolean"; break;
    case toml::node_type::array: type = "an array"; break;
    case toml::node_type::table: type = "a table"; break;
    default: type = "a date/time"; break;
  }
  return std::string(type) + " (" + text + ")";
}

[[noreturn]] void wrong_type(const FieldRef& f, const std::string& where, const std::string& got) {
  throw UserError(detail::concat(f.path(), " at ", where, ": expected ", type_name(f.value), ", got ", got));
}

std::optional<int64_t> parse_int(std::string_view text) {
  std::string t = trim(text);
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  int64_t out = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size()) return std::nullopt;
  return out;
}

std::optional<double> parse_double(std::string_view text) {
  std::string t = trim(text);
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  double out = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size()) return std::nullopt;
  return out;
}

// "a, b,c" -> ["a", "b", "c"] (split on `separator`, each part trimmed); "" -> [].
std::vector<std::string> split_list(std::string_view text, char separator = ',') {
  std::vector<std::string> out;
  if (trim(text).empty()) return out;
  size_t start = 0;
  while (true) {
    size_t at = text.find(separator, start);
    out.push_back(trim(text.substr(start, at == std::string_view::npos ? text.npos : at - start)));
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  return out;
}

// "a,b;c" -> [["a", "b"], ["c"]]; "" -> []. Empty parts and names are kept for validation to name.
std::vector<std::vector<std::string>> split_list_of_lists(std::string_view text) {
  std::vector<std::vector<std::string>> out;
  for (const std::string& part : split_list(text, ';')) out.push_back(split_list(part));
  return out;
}

void check_choice(const FieldRef& f, const std::string& where) {
  if (f.choices.empty()) return;
  const auto* s = std::get_if<std::string*>(&f.value);
  TITAN_ASSERT(s, "choices are only declared for string fields: ", f.path());
  if (std::find(f.choices.begin(), f.choices.end(), **s) != f.choices.end()) return;
  std::string allowed;
  for (const auto& c : f.choices) allowed += (allowed.empty() ? "" : ", ") + quote(c);
  std::string hint;
  if (auto near = nearest(**s, f.choices)) hint = detail::concat("; did you mean ", quote(*near), "?");
  throw UserError(detail::concat(f.path(), " at ", where, ": ", quote(**s), " is not one of ", allowed, hint));
}

}  // namespace

std::vector<FieldRef> fields_of(JobConfig& cfg) {
  FieldCollector c;
  cfg.visit(c);
  return std::move(c.fields);
}

namespace {
struct SectionLister {
  template <class S>
  void section(S&, const char* name, const char* help) {
    out.push_back({name, help});
  }
  std::vector<SectionInfo> out;
};
}  // namespace

const std::vector<SectionInfo>& sections() {
  static const std::vector<SectionInfo> list = [] {
    JobConfig cfg;
    SectionLister l;
    cfg.visit(l);
    return l.out;
  }();
  return list;
}

const FieldRef* find_field(const std::vector<FieldRef>& fields, std::string_view section, std::string_view key) {
  for (const auto& f : fields)
    if (f.section == section && f.key == key) return &f;
  return nullptr;
}

std::string type_name(const ValuePtr& v) {
  return std::visit(Overloaded{
                        [](bool*) { return "a boolean"; },
                        [](int64_t*) { return "an integer"; },
                        [](double*) { return "a number"; },
                        [](std::string*) { return "a string"; },
                        [](std::vector<std::string>*) { return "a list of strings"; },
                        [](std::vector<int64_t>*) { return "a list of integers"; },
                        [](std::vector<std::vector<std::string>>*) { return "a list of lists of strings"; },
                        [](std::optional<int64_t>*) { return "an integer (or none)"; },
                        [](std::optional<double>*) { return "a number (or none)"; },
                    },
                    v);
}

bool is_bool(const ValuePtr& v) { return std::holds_alternative<bool*>(v); }

bool is_optional(const ValuePtr& v) {
  return std::holds_alternative<std::optional<int64_t>*>(v) || std::holds_alternative<std::optional<double>*>(v);
}

bool is_set(const ValuePtr& v) {
  if (auto* p = std::get_if<std::optional<int64_t>*>(&v)) return (*p)->has_value();
  if (auto* p = std::get_if<std::optional<double>*>(&v)) return (*p)->has_value();
  return true;
}

std::string format_value(const ValuePtr& v) {
  return std::visit(Overloaded{
                        [](bool* b) -> std::string { return *b ? "true" : "false"; },
                        [](int64_t* i) -> std::string { return std::to_string(*i); },
                        [](double* d) { return format_double(*d); },
                        [](std::string* s) { return quote(*s); },
                        [](std::vector<std::string>* l) { return format_list(*l); },
                        [](std::vector<int64_t>* l) { return format_list(*l); },
                        [](std::vector<std::vector<std::string>>* l) { return format_list(*l); },
                        [](std::optional<int64_t>* o) -> std::string { return *o ? std::to_string(**o) : "none"; },
                        [](std::optional<double>* o) -> std::string { return *o ? format_double(**o) : "none"; },
                    },
                    v);
}

void set_from_toml(const FieldRef& f, const toml::node& node, const std::string& where) {
  auto as_int = [&]() -> int64_t {
    if (!node.is_integer()) wrong_type(f, where, describe(node));
    return node.as_integer()->get();
  };
  auto as_double = [&]() -> double {
    if (node.is_integer()) return static_cast<double>(node.as_integer()->get());
    if (!node.is_floating_point()) wrong_type(f, where, describe(node));
    return node.as_floating_point()->get();
  };
  auto as_list = [&]<class T>(std::vector<T>* out) {
    if constexpr (std::is_same_v<T, std::string>) {
      // A string where a list of strings goes holds its items separated by commas, as on the command
      // line and as torchtitan reads such a string (e.g. converters = "float8", filter_fqns = "output").
      if (node.is_string()) {
        *out = split_list(node.as_string()->get());
        return;
      }
    }
    if (!node.is_array()) wrong_type(f, where, describe(node));
    std::vector<T> items;
    for (const toml::node& item : *node.as_array()) {
      if constexpr (std::is_same_v<T, std::string>) {
        if (!item.is_string()) wrong_type(f, where, "an array holding " + describe(item));
        items.push_back(item.as_string()->get());
      } else {
        if (!item.is_integer()) wrong_type(f, where, "an array holding " + describe(item));
        items.push_back(item.as_integer()->get());
      }
    }
    *out = std::move(items);
  };
  std::visit(Overloaded{
                 [&](bool* b) {
                   if (!node.is_boolean()) wrong_type(f, where, describe(node));
                   *b = node.as_boolean()->get();
                 },
                 [&](int64_t* i) { *i = as_int(); },
                 [&](double* d) { *d = as_double(); },
                 [&](std::string* s) {
                   if (!node.is_string()) wrong_type(f, where, describe(node));
                   *s = node.as_string()->get();
                 },
                 [&](std::vector<std::string>* l) { as_list(l); },
                 [&](std::vector<int64_t>* l) { as_list(l); },
                 [&](std::vector<std::vector<std::string>>* l) {
                   if (!node.is_array()) wrong_type(f, where, describe(node));
                   std::vector<std::vector<std::string>> parts;
                   for (const toml::node& part : *node.as_array()) {
                     if (!part.is_array()) wrong_type(f, where, "an array holding " + describe(part));
                     std::vector<std::string> names;
                     for (const toml::node& name : *part.as_array()) {
                       if (!name.is_string()) wrong_type(f, where, "an array of arrays holding " + describe(name));
                       names.push_back(name.as_string()->get());
                     }
                     parts.push_back(std::move(names));
                   }
                   *l = std::move(parts);
                 },
                 [&](std::optional<int64_t>* o) { *o = as_int(); },
                 [&](std::optional<double>* o) { *o = as_double(); },
             },
             f.value);
  check_choice(f, where);
}

std::optional<bool> parse_bool(std::string_view text) {
  const std::string t = lower(trim(text));
  if (t == "true" || t == "1" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "0" || t == "no" || t == "off") return false;
  return std::nullopt;
}

void set_from_string(const FieldRef& f, std::string_view text, const std::string& where) {
  const std::string got = quote(text);
  const bool is_none = lower(trim(text)) == "none";
  auto int_or_fail = [&](std::string_view t) {
    auto v = parse_int(t);
    if (!v) wrong_type(f, where, quote(t));
    return *v;
  };
  auto double_or_fail = [&](std::string_view t) {
    auto v = parse_double(t);
    if (!v) wrong_type(f, where, quote(t));
    return *v;
  };
  std::visit(Overloaded{
                 [&](bool* b) {
                   auto v = parse_bool(text);
                   if (!v) wrong_type(f, where, got + " (use true or false)");
                   *b = *v;
                 },
                 [&](int64_t* i) { *i = int_or_fail(text); },
                 [&](double* d) { *d = double_or_fail(text); },
                 [&](std::string* s) { *s = std::string(text); },
                 [&](std::vector<std::string>* l) { *l = split_list(text); },
                 [&](std::vector<int64_t>* l) {
                   std::vector<int64_t> items;
                   for (const auto& item : split_list(text)) items.push_back(int_or_fail(item));
                   *l = std::move(items);
                 },
                 [&](std::vector<std::vector<std::string>>* l) { *l = split_list_of_lists(text); },
                 [&](std::optional<int64_t>* o) {
                   if (is_none) o->reset();
                   else *o = int_or_fail(text);
                 },
                 [&](std::optional<double>* o) {
                   if (is_none) o->reset();
                   else *o = double_or_fail(text);
                 },
             },
             f.value);
  check_choice(f, where);
}

}  // namespace titan::config
