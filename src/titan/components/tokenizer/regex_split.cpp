#include "titan/components/tokenizer/regex_split.h"

#include "titan/common/error.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace titan::tokenizer {

namespace {

// Unicode White_Space (PCRE2's \s and \p{Xsp} with UCP also hold U+180E).
constexpr std::string_view kWhiteSpaceMembers =
    R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// Per-thread matching state: match data (the whole match is all we read) and a JIT stack large
// enough for long runs of repeated characters.
struct ThreadMatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  ThreadMatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~ThreadMatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

std::string rewrite_whitespace_classes(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') {
        if (in_class) {
          out += kWhiteSpaceMembers;
        } else {
          out += "[";
          out += kWhiteSpaceMembers;
          out += "]";
        }
      } else if (e == 'S') {
        TITAN_USER_CHECK(!in_class, "unsupported pre-tokenizer regex: \\S inside a character class in '", pattern,
                         "'");
        out += "[^";
        out += kWhiteSpaceMembers;
        out += "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {  // [:alpha:]
      const size_t close = pattern.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out += pattern.substr(i, close + 2 - i);
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

struct RegexSplitter::Impl {
  pcre2_code* code = nullptr;
  ~Impl() { pcre2_code_free(code); }
};

RegexSplitter::RegexSplitter(std::string_view pattern, bool literal, const std::string& origin)
    : impl_(std::make_unique<Impl>()) {
  const std::string source = literal ? std::string(pattern) : rewrite_whitespace_classes(pattern);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options, &error,
                              &error_offset, nullptr);
  if (impl_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    throw UserError(detail::concat(origin, ": the pre-tokenizer pattern '", pattern, "' does not compile (",
                                   reinterpret_cast<const char*>(message), " at offset ", error_offset, ")"));
  }
  pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when JIT is unavailable
}

RegexSplitter::~RegexSplitter() = default;
RegexSplitter::RegexSplitter(RegexSplitter&&) noexcept = default;

void RegexSplitter::split(std::string_view text, const std::function<void(size_t, size_t, bool)>& on_piece) const {
  ThreadMatchState& state = thread_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t emitted = 0;  // end of the last emitted piece
  size_t offset = 0;   // where the next search starts
  while (offset <= text.size()) {
    const int rc = pcre2_match(impl_->code, subject, text.size(), offset, PCRE2_NO_UTF_CHECK, state.data,
                               state.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      throw UserError(detail::concat("pre-tokenizer regex failed on a text of ", text.size(),
                                     " bytes: ", reinterpret_cast<const char*>(message)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
    const size_t begin = ov[0], end = ov[1];
    if (end == begin) {  // empty match: ignore it and search again one character further
      if (begin >= text.size()) break;
      size_t step = 1;
      while (begin + step < text.size() && (static_cast<uint8_t>(text[begin + step]) & 0xC0) == 0x80) ++step;
      offset = begin + step;
      continue;
    }
    if (begin > emitted) on_piece(emitted, begin, false);
    on_piece(begin, end, true);
    emitted = offset = end;
  }
  if (emitted < text.size()) on_piece(emitted, text.size(), false);
}

}  // namespace titan::tokenizer
