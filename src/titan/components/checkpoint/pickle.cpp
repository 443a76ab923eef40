#include "titan/components/checkpoint/pickle.h"

#include <climits>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

namespace titan::pickle {

namespace {

const char* kind_name(Value::Kind k) {
  switch (k) {
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::Int: return "int";
    case Value::Kind::Float: return "float";
    case Value::Kind::String: return "str";
    case Value::Kind::Bytes: return "bytes";
    case Value::Kind::List: return "list";
    case Value::Kind::Tuple: return "tuple";
    case Value::Kind::Dict: return "dict";
    case Value::Kind::Set: return "set";
    case Value::Kind::Global: return "global";
    case Value::Kind::Object: return "object";
  }
  return "?";
}

}  // namespace

class Parser {
 public:
  explicit Parser(std::string_view d) : d_(d), budget_(16 * d.size() + 4096) {}

  Document run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = byte();
      try {
        if (step(op)) break;
      } catch (const std::exception& e) {  // also std::stoll's invalid_argument and out_of_range
        throw std::runtime_error("pickle: " + std::string(e.what()) + " (opcode 0x" + hex(op) + " at byte " +
                                 std::to_string(at) + ")");
      }
    }
    if (stack_.size() != 1) throw std::runtime_error("pickle: " + std::to_string(stack_.size()) + " values left at STOP");
    doc_.root_ = stack_.back();
    return std::move(doc_);
  }

 private:
  // Every value made and every item stored counts against a budget proportional to the input, so that
  // a small pickle cannot build a huge tree (memo references copied into containers over and over).
  void spend(size_t n) {
    if (n > budget_) throw std::runtime_error("the pickle builds far more values than its size allows");
    budget_ -= n;
  }
  Ref make(Value::Kind k) {
    spend(1);
    doc_.values_.push_back(std::make_unique<Value>());
    doc_.values_.back()->kind = k;
    return doc_.values_.back().get();
  }
  static std::string hex(uint8_t b) {
    const char* digits = "0123456789abcdef";
    return {digits[b >> 4], digits[b & 15]};
  }
  void need(size_t n) const {
    if (n > d_.size() - pos_)
      throw std::runtime_error("pickle: truncated (" + std::to_string(n) + " bytes needed at byte " + std::to_string(pos_) +
                               " of " + std::to_string(d_.size()) + ")");
  }
  uint8_t byte() {
    need(1);
    return static_cast<uint8_t>(d_[pos_++]);
  }
  uint64_t uint_le(int n) {
    need(static_cast<size_t>(n));
    uint64_t v = 0;
    for (int k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(d_[pos_ + k])) << (8 * k);
    pos_ += static_cast<size_t>(n);
    return v;
  }
  std::string_view bytes(uint64_t n) {
    if (n > d_.size() - pos_) need(d_.size() - pos_ + 1);
    std::string_view s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string_view line() {
    const size_t end = d_.find('\n', pos_);
    if (end == std::string_view::npos) throw std::runtime_error("unterminated line");
    std::string_view s = d_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }
  Ref pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) throw std::runtime_error("stack underflow");
    Ref v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Ref& top() {
    if (stack_.empty()) throw std::runtime_error("stack underflow");
    return stack_.back();
  }
  std::vector<Ref> pop_mark() {
    if (marks_.empty()) throw std::runtime_error("no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Ref> out(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }
  void push(Ref v) { stack_.push_back(std::move(v)); }
  void push_int(int64_t i) {
    Ref v = make(Value::Kind::Int);
    v->i = i;
    push(v);
  }
  void push_string(std::string_view s, Value::Kind k) {
    Ref v = make(k);
    v->s = std::string(s);
    push(v);
  }
  void push_tuple(std::vector<Ref> items) {
    Ref v = make(Value::Kind::Tuple);
    v->items = std::move(items);
    push(v);
  }
  void put(uint64_t index) { memo_[index] = top(); }
  void get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) throw std::runtime_error("memo index " + std::to_string(index) + " unset");
    push(it->second);
  }
  // A later value of a key replaces an earlier one as Python's dict does: get() looks from the end.
  void set_items(Value& target, const std::vector<Ref>& kv) {
    if (target.kind != Value::Kind::Dict) throw std::runtime_error(std::string("SETITEM on a ") + kind_name(target.kind));
    if (kv.size() % 2) throw std::runtime_error("odd number of items for SETITEMS");
    spend(kv.size());
    for (size_t k = 0; k < kv.size(); k += 2) target.dict.emplace_back(kv[k], kv[k + 1]);
  }
  void append_items(Value& target, const std::vector<Ref>& items) {
    if (target.kind != Value::Kind::List && target.kind != Value::Kind::Set)
      throw std::runtime_error(std::string("APPEND on a ") + kind_name(target.kind));
    spend(items.size());
    target.items.insert(target.items.end(), items.begin(), items.end());
  }
  // A call of `callable` with `args`: builtin containers become values, anything else an object.
  Ref call(const Ref& callable, const Ref& args) {
    if (callable->kind != Value::Kind::Global) throw std::runtime_error(std::string("call of a ") + kind_name(callable->kind));
    if (args->kind != Value::Kind::Tuple) throw std::runtime_error("call arguments are not a tuple");
    const std::string& name = callable->s;
    if (name == "collections.OrderedDict" || name == "builtins.dict") {
      Ref d = make(Value::Kind::Dict);
      if (!args->items.empty() && args->items[0]->kind == Value::Kind::List)
        spend(args->items[0]->items.size());
      if (!args->items.empty() && args->items[0]->kind == Value::Kind::List)
        for (const Ref& pair : args->items[0]->items)
          if (pair->kind == Value::Kind::Tuple && pair->items.size() == 2) d->dict.emplace_back(pair->items[0], pair->items[1]);
      return d;
    }
    if (name == "builtins.set" || name == "builtins.frozenset") {
      Ref s = make(Value::Kind::Set);
      if (!args->items.empty()) {
        spend(args->items[0]->items.size());
        s->items = args->items[0]->items;
      }
      return s;
    }
    if (name == "_codecs.encode" && args->items.size() == 2 && args->items[0]->kind == Value::Kind::String) {
      // Protocol 2's bytes: their text as code points below 256 (latin-1), encoded again on loading.
      Ref b = make(Value::Kind::Bytes);
      const std::string& u = args->items[0]->s;  // UTF-8
      spend(u.size());
      for (size_t k = 0; k < u.size(); ++k) {
        const auto c = static_cast<unsigned char>(u[k]);
        if (c < 0x80) {
          b->s += static_cast<char>(c);
        } else if ((c & 0xE0) == 0xC0 && k + 1 < u.size() && c <= 0xC3) {
          b->s += static_cast<char>(((c & 0x1F) << 6) | (static_cast<unsigned char>(u[++k]) & 0x3F));
        } else {
          throw std::runtime_error("encoded bytes hold a code point above 255");
        }
      }
      return b;
    }
    if ((name == "builtins.bytes" || name == "builtins.bytearray") && args->items.empty()) return make(Value::Kind::Bytes);
    if (name == "copyreg._reconstructor" && !args->items.empty() && args->items[0]->kind == Value::Kind::Global) {
      Ref o = make(Value::Kind::Object);
      o->s = args->items[0]->s;
      return o;
    }
    Ref o = make(Value::Kind::Object);
    o->s = name;
    spend(args->items.size());
    o->items = args->items;
    return o;
  }

  // Executes one opcode; true at STOP.
  bool step(uint8_t op) {
    switch (op) {
      case 0x80: byte(); return false;                         // PROTO
      case 0x95: uint_le(8); return false;                     // FRAME (frames are only a read-ahead hint)
      case '.': return true;                                   // STOP
      case '(': marks_.push_back(stack_.size()); return false; // MARK
      case '0': pop(); return false;                           // POP
      case '1': pop_mark(); return false;                      // POP_MARK
      case '2': push(top()); return false;                     // DUP
      case 'N': push(make(Value::Kind::None)); return false;
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        Ref v = make(Value::Kind::Bool);
        v->b = op == 0x88;
        push(v);
        return false;
      }
      case 'J': push_int(static_cast<int32_t>(uint_le(4))); return false;  // BININT
      case 'K': push_int(static_cast<int64_t>(uint_le(1))); return false;  // BININT1
      case 'M': push_int(static_cast<int64_t>(uint_le(2))); return false;  // BININT2
      case 0x8a:
      case 0x8b: {  // LONG1, LONG4: little-endian two's complement
        const uint64_t n = uint_le(op == 0x8a ? 1 : 4);
        if (n > 8) throw std::runtime_error("integer of " + std::to_string(n) + " bytes does not fit 64 bits");
        uint64_t u = n ? uint_le(static_cast<int>(n)) : 0;
        if (n > 0 && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~uint64_t{0} << (8 * n);  // sign-extend
        push_int(static_cast<int64_t>(u));
        return false;
      }
      case 'I': {  // INT (text): also True/False as I01/I00
        const std::string s(line());
        if (s == "01" || s == "00") {
          Ref v = make(Value::Kind::Bool);
          v->b = s == "01";
          push(v);
        } else {
          push_int(std::stoll(s));
        }
        return false;
      }
      case 'G': {  // BINFLOAT: big-endian double
        need(8);
        uint64_t u = 0;
        for (int k = 0; k < 8; ++k) u = (u << 8) | static_cast<uint8_t>(d_[pos_ + k]);
        pos_ += 8;
        Ref v = make(Value::Kind::Float);
        std::memcpy(&v->f, &u, 8);
        push(v);
        return false;
      }
      case 'X': push_string(bytes(uint_le(4)), Value::Kind::String); return false;   // BINUNICODE
      case 0x8c: push_string(bytes(uint_le(1)), Value::Kind::String); return false;  // SHORT_BINUNICODE
      case 0x8d: push_string(bytes(uint_le(8)), Value::Kind::String); return false;  // BINUNICODE8
      case 'T': push_string(bytes(uint_le(4)), Value::Kind::String); return false;   // BINSTRING
      case 'U': push_string(bytes(uint_le(1)), Value::Kind::String); return false;   // SHORT_BINSTRING
      case 'B': push_string(bytes(uint_le(4)), Value::Kind::Bytes); return false;    // BINBYTES
      case 'C': push_string(bytes(uint_le(1)), Value::Kind::Bytes); return false;    // SHORT_BINBYTES
      case 0x8e:
      case 0x96: push_string(bytes(uint_le(8)), Value::Kind::Bytes); return false;   // BINBYTES8, BYTEARRAY8
      case ')': push_tuple({}); return false;                                         // EMPTY_TUPLE
      case 't': push_tuple(pop_mark()); return false;                                 // TUPLE
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        std::vector<Ref> items(static_cast<size_t>(op - 0x84));
        for (size_t k = items.size(); k-- > 0;) items[k] = pop();
        push_tuple(std::move(items));
        return false;
      }
      case ']': push(make(Value::Kind::List)); return false;  // EMPTY_LIST
      case 'l': {                                               // LIST
        Ref v = make(Value::Kind::List);
        v->items = pop_mark();
        push(v);
        return false;
      }
      case 'a': {  // APPEND
        Ref item = pop();
        append_items(*top(), {item});
        return false;
      }
      case 'e': {  // APPENDS
        std::vector<Ref> items = pop_mark();
        append_items(*top(), items);
        return false;
      }
      case '}': push(make(Value::Kind::Dict)); return false;  // EMPTY_DICT
      case 'd': {                                               // DICT
        Ref v = make(Value::Kind::Dict);
        set_items(*v, pop_mark());
        push(v);
        return false;
      }
      case 's': {  // SETITEM
        Ref value = pop(), key = pop();
        set_items(*top(), {key, value});
        return false;
      }
      case 'u': {  // SETITEMS
        std::vector<Ref> kv = pop_mark();
        set_items(*top(), kv);
        return false;
      }
      case 0x8f: push(make(Value::Kind::Set)); return false;  // EMPTY_SET
      case 0x90: {                                              // ADDITEMS
        std::vector<Ref> items = pop_mark();
        append_items(*top(), items);
        return false;
      }
      case 0x91: {  // FROZENSET
        Ref v = make(Value::Kind::Set);
        v->items = pop_mark();
        push(v);
        return false;
      }
      case 'c': {  // GLOBAL: module\nname\n (protocol 2 writes Python 2's module names)
        std::string module(line());
        std::string name(line());
        if (module == "__builtin__") module = "builtins";
        if (module == "copy_reg") module = "copyreg";
        push_string(module + "." + name, Value::Kind::Global);
        return false;
      }
      case 0x93: {  // STACK_GLOBAL
        Ref name = pop(), module = pop();
        if (module->kind != Value::Kind::String || name->kind != Value::Kind::String)
          throw std::runtime_error("STACK_GLOBAL of non-strings");
        push_string(module->s + "." + name->s, Value::Kind::Global);
        return false;
      }
      case 'R': {  // REDUCE
        Ref args = pop(), callable = pop();
        push(call(callable, args));
        return false;
      }
      case 0x81: {  // NEWOBJ
        Ref args = pop(), cls = pop();
        push(call(cls, args));
        return false;
      }
      case 0x92: {  // NEWOBJ_EX (keyword arguments are dropped)
        pop();
        Ref args = pop(), cls = pop();
        push(call(cls, args));
        return false;
      }
      case 'b': {  // BUILD
        Ref state = pop();
        Value& obj = *top();
        if (obj.kind == Value::Kind::Object) {
          obj.state = state;
        } else {
          throw std::runtime_error(std::string("BUILD on a ") + kind_name(obj.kind));
        }
        return false;
      }
      case 'p': put(std::stoull(std::string(line()))); return false;  // PUT
      case 'q': put(uint_le(1)); return false;                         // BINPUT
      case 'r': put(uint_le(4)); return false;                         // LONG_BINPUT
      case 0x94: put(memo_.size()); return false;                      // MEMOIZE
      case 'g': get(std::stoull(std::string(line()))); return false;  // GET
      case 'h': get(uint_le(1)); return false;                         // BINGET
      case 'j': get(uint_le(4)); return false;                         // LONG_BINGET
      case 'P':
      case 'Q': {  // PERSID, BINPERSID: a reference to data outside the pickle (torch.save's storages)
        Ref pid = op == 'Q' ? pop() : nullptr;
        Ref o = make(Value::Kind::Object);
        o->s = "persistent_id";
        if (op == 'P') {
          pid = make(Value::Kind::String);
          pid->s = std::string(line());
        }
        o->items = {pid};
        push(o);
        return false;
      }
      case 0x97:
      case 0x98: throw std::runtime_error("out-of-band buffers are not supported");
      default: throw std::runtime_error("unsupported opcode");
    }
  }

  std::string_view d_;
  size_t pos_ = 0;
  std::vector<Ref> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Ref> memo_;  // indices as the pickle gives them (sparse ones included)
  Document doc_;
  size_t budget_;
};

int64_t Value::as_int() const {
  if (kind == Kind::Int) return i;
  if (kind == Kind::Bool) return b ? 1 : 0;
  throw std::runtime_error(std::string("expected an int, found a ") + kind_name(kind));
}

const std::string& Value::as_string() const {
  if (kind == Kind::String || kind == Kind::Global) return s;
  throw std::runtime_error(std::string("expected a str, found a ") + kind_name(kind));
}

const Value* Value::get(std::string_view key) const {
  const Value* d = this;
  if (kind == Kind::Object) {
    if (!state) return nullptr;
    d = state;
    // (dict, slots) pairs: look in both.
    if (d->kind == Kind::Tuple && d->items.size() == 2) {
      for (const Ref& part : d->items)
        if (part->kind == Kind::Dict)
          if (const Value* v = part->get(key)) return v;
      return nullptr;
    }
  }
  if (d->kind != Kind::Dict) return nullptr;
  for (auto it = d->dict.rbegin(); it != d->dict.rend(); ++it)  // the last value of a key, as in Python
    if (it->first->kind == Kind::String && it->first->s == key) return it->second;
  return nullptr;
}

const Value& Value::at(std::string_view key) const {
  const Value* v = get(key);
  if (!v) throw std::runtime_error("no '" + std::string(key) + "' in a " + kind_name(kind) + (kind == Kind::Object ? " " + s : ""));
  return *v;
}

const std::vector<Ref>& Value::sequence() const {
  if (kind == Kind::List || kind == Kind::Tuple) return items;
  if (kind == Kind::Object && items.size() == 1 &&
      (items[0]->kind == Kind::Tuple || items[0]->kind == Kind::List))
    return items[0]->items;
  throw std::runtime_error(std::string("expected a sequence, found a ") + kind_name(kind) + (kind == Kind::Object ? " " + s : ""));
}

Document parse(std::string_view data) { return Parser(data).run(); }

namespace {

// The low `bytes` bytes of `v`, little-endian.
void append_le(std::string& out, uint64_t v, int bytes) {
  for (int k = 0; k < bytes; ++k) out += static_cast<char>((v >> (8 * k)) & 0xff);
}

}  // namespace

Writer::Writer() { out_ += "\x80\x02"; }  // PROTO 2
void Writer::none() { out_ += 'N'; }
void Writer::boolean(bool b) { out_ += b ? '\x88' : '\x89'; }
void Writer::integer(int64_t i) {
  if (i >= INT32_MIN && i <= INT32_MAX) {  // BININT: 4 bytes, little-endian, signed
    out_ += 'J';
    append_le(out_, static_cast<uint32_t>(static_cast<int32_t>(i)), 4);
    return;
  }
  out_ += "\x8a\x08";  // LONG1 of 8 bytes, little-endian two's complement
  append_le(out_, static_cast<uint64_t>(i), 8);
}
void Writer::real(double d) {  // BINFLOAT: 8 bytes, big-endian
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  out_ += 'G';
  for (int k = 7; k >= 0; --k) out_ += static_cast<char>((bits >> (8 * k)) & 0xff);
}
void Writer::string(std::string_view s) {  // BINUNICODE: 4-byte length, UTF-8
  out_ += 'X';
  append_le(out_, s.size(), 4);
  out_ += s;
}
void Writer::global_(std::string_view module, std::string_view name) {
  out_ += 'c';
  out_ += module;
  out_ += '\n';
  out_ += name;
  out_ += '\n';
}
void Writer::mark() { out_ += '('; }
void Writer::tuple() { out_ += 't'; }
void Writer::empty_tuple() { out_ += ')'; }
void Writer::empty_dict() { out_ += '}'; }
void Writer::setitems() { out_ += 'u'; }
void Writer::empty_list() { out_ += ']'; }
void Writer::appends() { out_ += 'e'; }
void Writer::newobj() { out_ += '\x81'; }
void Writer::reduce() { out_ += 'R'; }
void Writer::build() { out_ += 'b'; }
void Writer::persid() { out_ += 'Q'; }
std::string Writer::finish() {
  out_ += '.';
  return std::move(out_);
}

}  // namespace titan::pickle
