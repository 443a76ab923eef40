// A reader of Python pickles (protocols 2 to 5) that builds a tree of plain values and never runs
// code: a global (a class or function reference) becomes a name, and calling or instantiating it
// (REDUCE, NEWOBJ) becomes an object holding that name, its arguments and the state BUILD gave it.
// It reads what torch.distributed.checkpoint writes as `.metadata` (dataclasses, torch.Size, dtypes,
// enums, paths) and any other pickle of plain containers. A persistent id (torch.save's reference to
// a storage) becomes an object named "persistent_id" holding the id; out-of-band buffers are errors.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace titan::pickle {

struct Value;
using Ref = Value*;  // owned by the Document the value belongs to

struct Value {
  enum class Kind { None, Bool, Int, Float, String, Bytes, List, Tuple, Dict, Set, Global, Object };
  Kind kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                           // String, Bytes; Global and Object: "module.name"
  std::vector<Ref> items;                  // List, Tuple, Set; Object: the arguments
  std::vector<std::pair<Ref, Ref>> dict;   // Dict, in insertion order
  Ref state = nullptr;                     // Object: what BUILD set (a dict, a tuple, ...), or null

  // Accessors that throw std::runtime_error naming what was expected.
  int64_t as_int() const;
  const std::string& as_string() const;
  // Dict or object-state lookup by string key: nullptr when absent. For an Object, looks in its state
  // (a dict, or the dict of a (dict, slots) pair).
  const Value* get(std::string_view key) const;
  const Value& at(std::string_view key) const;  // throws when absent
  // Items of a List or Tuple, or of an Object built from one tuple argument (torch.Size((3, 4))).
  const std::vector<Ref>& sequence() const;
};

// A parsed pickle: its values, owned together (a pickle may hold cycles: a list that contains itself).
class Document {
 public:
  const Value& root() const { return *root_; }
  // Every value the pickle made, reachable from the root or not, in the order made.
  const std::vector<std::unique_ptr<Value>>& values() const { return values_; }

 private:
  friend class Parser;
  std::vector<std::unique_ptr<Value>> values_;
  Value* root_ = nullptr;
};

// Parses one pickle. Throws std::runtime_error (with the byte offset) on malformed or unsupported input.
Document parse(std::string_view data);

// Writes a protocol 2 pickle opcode by opcode (the caller keeps the stack balanced), enough for
// dataclass objects such as torch.distributed.checkpoint's Metadata: a class is `global_` then
// `empty_tuple` and `newobj`, its fields a dict then `build`; a call is the callable, an argument
// tuple and `reduce`. No memo: every value is written where it is used.
class Writer {
 public:
  Writer();
  void none();
  void boolean(bool b);
  void integer(int64_t i);
  void real(double d);
  void string(std::string_view s);
  void global_(std::string_view module, std::string_view name);
  void mark();
  void tuple();        // from the last mark
  void empty_tuple();
  void empty_dict();
  void setitems();     // key, value pairs since the last mark into the dict below the mark
  void empty_list();
  void appends();      // items since the last mark onto the list below the mark
  void newobj();       // cls, args -> cls.__new__(cls, *args)
  void reduce();       // callable, args -> callable(*args)
  void build();        // object, state -> object with that state
  void persid();       // id -> persistent_load(id) (torch.save's reference to a storage record)
  // The pickle, ended with STOP.
  std::string finish();

 private:
  std::string out_;
};

}  // namespace titan::pickle
