// Reads what `torch.save` writes without LibTorch: a small zip reader and the subset of Python's
// pickle machine that torch.save emits around tensors.
//
// Why our own reader: LibTorch 1.13's unpickler (torch::jit::pickle_load) knows only what
// TorchScript writes, so it rejects ordinary torch.save files (a one-entry dict is pickled with
// SETITEM, which it lacks) and it pulls in ~270 shared libraries. The format is small: a zip
// archive of stored (uncompressed) entries, `<archive>/data.pkl` (the pickled object tree, tensors
// as calls of torch._utils._rebuild_tensor_v2 on persistent storage ids) and one entry
// `<archive>/data/<key>` of raw little-endian bytes per storage.
//
// Rules, because the bytes come from outside (and are fuzzed under ASan/UBSan):
// - every offset, length and count is checked against the buffer before use, with overflow checks;
// - nothing is allocated from a length field before the bytes it describes are known to exist;
// - the pickle machine runs one opcode per input byte at least, so it ends; objects live in an
//   arena (cycles a hostile pickle builds cannot leak) and values are small handles into it, so
//   copying a value (BINGET, DUP) never copies a string or a container;
// - flattening is bounded in depth (a container that contains itself ends there) and the whole
//   result (tensor bytes, names, metadata) in size: more than 16x the input plus 64 MiB can only
//   come from a pickle that references the same objects over and over;
// - every fault is one TorchFileError line "<name>: <fault>".
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/torch_io.h"

namespace twin {
namespace {

constexpr int kMaxDepth = 64;           // container nesting when flattening
constexpr std::size_t kMaxRank = 64;    // tensor dimensions (torch's own limit is 64 too)
constexpr std::size_t kMaxName = 4096;  // a flattened dotted name

class Fail {
 public:
  explicit Fail(std::string name) : name_(std::move(name)) {}
  [[noreturn]] void operator()(const std::string& fault) const {
    std::string line = fault;
    std::replace(line.begin(), line.end(), '\n', ' ');
    std::replace(line.begin(), line.end(), '\r', ' ');
    throw TorchFileError(name_ + ": " + line);
  }

 private:
  std::string name_;
};

// Quotes text from the file for a message: printable ASCII kept, the rest escaped, long text cut.
std::string quoted(std::string_view s) {
  std::string r = "'";
  for (std::size_t i = 0; i < s.size() && i < 80; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'') {
      r += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      r += buf;
    }
  }
  if (s.size() > 80) r += "...";
  return r + "'";
}

std::uint16_t u16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] | (p[1] << 8)); }
std::uint32_t u32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
std::uint64_t u64(const std::uint8_t* p) { return u32(p) | (static_cast<std::uint64_t>(u32(p + 4)) << 32); }

// ---- zip ---------------------------------------------------------------------------------------

// The zip CRC-32 (zlib's, the one the format names).
std::uint32_t crc32_of(const std::uint8_t* p, std::size_t n) {
  uLong c = ::crc32(0L, Z_NULL, 0);
  for (std::size_t done = 0; done < n;) {  // zlib takes uInt lengths
    const uInt chunk = static_cast<uInt>(std::min<std::size_t>(n - done, 1u << 30));
    c = ::crc32(c, p + done, chunk);
    done += chunk;
  }
  return static_cast<std::uint32_t>(c);
}

struct ZipEntry {
  std::uint16_t method = 0;
  std::uint16_t flags = 0;
  std::uint32_t crc = 0;
  std::uint64_t size = 0;   // uncompressed
  std::uint64_t csize = 0;  // compressed
  std::uint64_t local = 0;  // offset of the local header
};

// The central directory of a zip archive; entries are read (and their CRC checked) on demand.
class Zip {
 public:
  Zip(const Fail& fail, const std::uint8_t* data, std::size_t size) : fail_(fail), data_(data), size_(size) {
    // End of central directory: 22 bytes (+ a comment of up to 64 KiB) at the end of the file.
    if (size < 22) fail_("truncated zip archive: end of central directory not found");
    std::size_t eocd = SIZE_MAX;
    const std::size_t lowest = size - 22 > 0xFFFF ? size - 22 - 0xFFFF : 0;
    for (std::size_t pos = size - 22 + 1; pos-- > lowest;) {
      if (u32(data + pos) == 0x06054b50u && pos + 22 + u16(data + pos + 20) <= size) {
        eocd = pos;
        break;
      }
    }
    if (eocd == SIZE_MAX) fail_("truncated zip archive: end of central directory not found");
    const std::uint8_t* e = data + eocd;
    std::uint64_t count = u16(e + 10), cd_size = u32(e + 12), cd_offset = u32(e + 16);
    if (u16(e + 4) != 0 || u16(e + 6) != 0) fail_("multi-disk zip archives are unsupported");
    if (count == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_offset == 0xFFFFFFFFu) {
      // ZIP64: a locator just before the end record points at the 64-bit end record.
      if (eocd < 20 || u32(data + eocd - 20) != 0x07064b50u) fail_("zip64 end of central directory locator missing");
      const std::uint64_t at = u64(data + eocd - 20 + 8);
      if (at > eocd - 20 || eocd - 20 - at < 56 || u32(data + at) != 0x06064b50u)
        fail_("zip64 end of central directory record missing or out of bounds");
      count = u64(data + at + 32);
      cd_size = u64(data + at + 40);
      cd_offset = u64(data + at + 48);
    }
    if (cd_offset > size || cd_size > size - cd_offset)
      fail_("zip central directory (offset " + std::to_string(cd_offset) + ", " + std::to_string(cd_size) +
            " bytes) lies outside the " + std::to_string(size) + "-byte file");
    if (count > cd_size / 46)
      fail_("zip central directory claims " + std::to_string(count) + " entries in " + std::to_string(cd_size) +
            " bytes");
    const std::uint8_t* p = data + cd_offset;
    const std::uint8_t* end = p + cd_size;
    for (std::uint64_t i = 0; i < count; ++i) {
      if (end - p < 46 || u32(p) != 0x02014b50u)
        fail_("zip central directory entry " + std::to_string(i) + " is corrupt");
      ZipEntry z;
      z.flags = u16(p + 8);
      z.method = u16(p + 10);
      z.crc = u32(p + 16);
      z.csize = u32(p + 20);
      z.size = u32(p + 24);
      const std::size_t name_len = u16(p + 28), extra_len = u16(p + 30), comment_len = u16(p + 32);
      z.local = u32(p + 42);
      if (static_cast<std::size_t>(end - p) < 46 + name_len + extra_len + comment_len)
        fail_("zip central directory entry " + std::to_string(i) + " runs past the directory");
      const std::string name(reinterpret_cast<const char*>(p + 46), name_len);
      // ZIP64 extended information: the saturated 32-bit fields, in this order.
      const std::uint8_t* x = p + 46 + name_len;
      const std::uint8_t* xend = x + extra_len;
      while (xend - x >= 4) {
        const std::uint16_t id = u16(x), len = u16(x + 2);
        if (static_cast<std::size_t>(xend - x - 4) < len)
          fail_("zip extra field of entry " + quoted(name) + " is corrupt");
        if (id == 0x0001) {
          const std::uint8_t* f = x + 4;
          std::size_t left = len;
          for (std::uint64_t* field : {&z.size, &z.csize, &z.local}) {
            if (*field != 0xFFFFFFFFu) continue;
            if (left < 8) fail_("zip64 extra field of entry " + quoted(name) + " is too short");
            *field = u64(f);
            f += 8;
            left -= 8;
          }
        }
        x += 4 + len;
      }
      entries_.emplace(name, z);  // a repeated name keeps its first entry
      p += 46 + name_len + extra_len + comment_len;
    }
  }

  const std::map<std::string, ZipEntry>& entries() const { return entries_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }

  // The bytes of a stored entry, CRC checked once (tensors sharing a storage read it again).
  std::pair<const std::uint8_t*, std::size_t> read(const std::string& name) const {
    if (const auto c = checked_.find(name); c != checked_.end()) return c->second;
    const auto it = entries_.find(name);
    if (it == entries_.end()) fail_("zip archive has no entry " + quoted(name));
    const ZipEntry& z = it->second;
    if (z.flags & 1) fail_("zip entry " + quoted(name) + " is encrypted");
    if (z.method != 0)
      fail_("zip entry " + quoted(name) + " is compressed (method " + std::to_string(z.method) +
            "); torch.save writes stored entries");
    if (z.csize != z.size) fail_("zip entry " + quoted(name) + " is stored but its sizes differ");
    if (z.local > size_ || size_ - z.local < 30 || u32(data_ + z.local) != 0x04034b50u)
      fail_("zip local header of " + quoted(name) + " is missing or out of bounds");
    const std::uint64_t start = z.local + 30 + u16(data_ + z.local + 26) + u16(data_ + z.local + 28);
    if (start > size_ || z.size > size_ - start)
      fail_("zip entry " + quoted(name) + " (" + std::to_string(z.size) + " bytes at " + std::to_string(start) +
            ") runs past the end of the " + std::to_string(size_) + "-byte file (truncated?)");
    const std::uint8_t* p = data_ + start;
    const std::size_t n = static_cast<std::size_t>(z.size);
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION  // fuzz builds: let mutated bytes reach the pickle machine
    if (crc32_of(p, n) != z.crc) fail_("zip entry " + quoted(name) + " fails its CRC check (corrupt file)");
#endif
    checked_.emplace(name, std::make_pair(p, n));
    return {p, n};
  }

 private:
  const Fail& fail_;
  const std::uint8_t* data_;
  std::size_t size_;
  std::map<std::string, ZipEntry> entries_;
  mutable std::map<std::string, std::pair<const std::uint8_t*, std::size_t>> checked_;
};

// ---- storage dtypes ----------------------------------------------------------------------------

struct ElemType {
  const char* torch_name = "";  // "float32", for messages
  std::size_t size = 1;
  std::optional<DType> dtype;  // empty: a torch dtype twin's Tensor cannot hold
};

// torch.<X>Storage (and torch.cuda.<X>Storage of old files) -> element type.
std::optional<ElemType> storage_elem(std::string_view global) {
  std::string_view n = global;
  for (std::string_view prefix : {"torch.cuda.", "torch."})
    if (n.substr(0, prefix.size()) == prefix) {
      n.remove_prefix(prefix.size());
      break;
    }
  static const std::map<std::string_view, ElemType, std::less<>> known = {
      {"DoubleStorage", {"float64", 8, DType::F64}},
      {"FloatStorage", {"float32", 4, DType::F32}},
      {"HalfStorage", {"float16", 2, DType::F16}},
      {"BFloat16Storage", {"bfloat16", 2, DType::BF16}},
      {"LongStorage", {"int64", 8, DType::I64}},
      {"IntStorage", {"int32", 4, DType::I32}},
      {"BoolStorage", {"bool", 1, DType::BOOL}},
      {"ShortStorage", {"int16", 2, std::nullopt}},
      {"CharStorage", {"int8", 1, std::nullopt}},
      {"ByteStorage", {"uint8", 1, std::nullopt}},
      {"ComplexFloatStorage", {"complex64", 8, std::nullopt}},
      {"ComplexDoubleStorage", {"complex128", 16, std::nullopt}},
      {"QInt8Storage", {"qint8", 1, std::nullopt}},
      {"QUInt8Storage", {"quint8", 1, std::nullopt}},
      {"QInt32Storage", {"qint32", 4, std::nullopt}},
      {"QUInt4x2Storage", {"quint4x2", 1, std::nullopt}},
      {"QUInt2x4Storage", {"quint2x4", 1, std::nullopt}},
      {"UntypedStorage", {"uint8", 1, std::nullopt}},  // bytes; _rebuild_tensor_v3 names the dtype
  };
  if (n.size() == global.size()) return std::nullopt;  // not in torch
  const auto it = known.find(n);
  if (it == known.end()) return std::nullopt;
  return it->second;
}

// torch.<dtype> (the dtype argument of _rebuild_tensor_v3) -> element type.
std::optional<ElemType> dtype_elem(std::string_view global) {
  static const std::map<std::string_view, ElemType, std::less<>> known = {
      {"torch.float64", {"float64", 8, DType::F64}}, {"torch.float32", {"float32", 4, DType::F32}},
      {"torch.float16", {"float16", 2, DType::F16}}, {"torch.bfloat16", {"bfloat16", 2, DType::BF16}},
      {"torch.int64", {"int64", 8, DType::I64}},     {"torch.int32", {"int32", 4, DType::I32}},
      {"torch.bool", {"bool", 1, DType::BOOL}},
  };
  const auto it = known.find(global);
  if (it != known.end()) return it->second;
  return std::nullopt;
}

// ---- pickle values -----------------------------------------------------------------------------

enum class Kind : std::uint8_t { None, Bool, Int, Float, Str, Bytes, Obj };

// A small handle: numbers inline, strings and objects by index into the machine's arenas.
struct Value {
  Kind kind = Kind::None;
  union {
    std::int64_t i = 0;  // Bool, Int; the arena index of Str, Bytes, Obj
    double f;            // Float
  };
};

enum class ObjKind : std::uint8_t { List, Tuple, Dict, Global, Storage, Tensor };

// Lists and tuples (most objects of a pickle) are an item vector; the rest of an object lives in
// `x`, allocated only for the kinds that use it, so a pickle of many small containers stays small
// in memory (about 64 bytes per input byte at worst).
struct Extra {
  std::vector<Value> keys;                                      // Dict keys, parallel to items
  std::unordered_map<std::string_view, std::size_t> str_index;  // Dict: str key -> position
  std::unordered_map<std::int64_t, std::size_t> int_index;      // Dict: int/bool key -> position
  std::string name;                                             // Global "module.name"; Storage key
  // Storage: element type and element count; Tensor: storage (an Obj index) and view.
  ElemType elem;
  std::int64_t numel = 0;
  std::size_t storage = 0;
  std::int64_t offset = 0;
  std::vector<std::int64_t> sizes, strides;
};

struct Obj {
  ObjKind kind;
  std::vector<Value> items;  // List, Tuple; Dict values
  std::unique_ptr<Extra> x;  // Dict, Global, Storage, Tensor
};

const char* kind_name(const Value& v, const std::vector<std::unique_ptr<Obj>>& objs) {
  switch (v.kind) {
    case Kind::None:
      return "None";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::Str:
      return "str";
    case Kind::Bytes:
      return "bytes";
    case Kind::Obj:
      break;
  }
  switch (objs[static_cast<std::size_t>(v.i)]->kind) {
    case ObjKind::List:
      return "list";
    case ObjKind::Tuple:
      return "tuple";
    case ObjKind::Dict:
      return "dict";
    case ObjKind::Global:
      return "global";
    case ObjKind::Storage:
      return "storage";
    case ObjKind::Tensor:
      return "tensor";
  }
  return "?";
}

// Python's repr of a float: the shortest digits that read back to the same double, in fixed
// notation for decimal exponents -4..15 and scientific ("1e-05", "1.5e+16") outside.
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  const std::string sci(buf, r.ptr);  // "-1.2345e+02"
  const std::size_t e = sci.find('e');
  const bool neg = sci[0] == '-';
  std::string digits;
  for (std::size_t k = neg ? 1 : 0; k < e; ++k)
    if (sci[k] != '.') digits += sci[k];
  const int exp = std::atoi(sci.c_str() + e + 1);
  std::string s = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      s += "0." + std::string(static_cast<std::size_t>(-exp - 1), '0') + digits;
    } else {
      const std::size_t whole = static_cast<std::size_t>(exp) + 1;
      if (digits.size() <= whole) {
        s += digits + std::string(whole - digits.size(), '0') + ".0";
      } else {
        s += digits.substr(0, whole) + "." + digits.substr(whole);
      }
    }
  } else {
    s += digits.substr(0, 1);
    if (digits.size() > 1) s += "." + digits.substr(1);
    char ex[16];
    std::snprintf(ex, sizeof ex, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    s += ex;
  }
  return s;
}

// ---- the pickle machine ------------------------------------------------------------------------

class Unpickler {
 public:
  Unpickler(const Fail& fail, const std::uint8_t* p, std::size_t n) : fail_(fail), p_(p), n_(n) {}

  Value run() {
    while (true) {
      if (pos_ >= n_) fail_("pickle data.pkl ends without STOP (truncated?)");
      const std::size_t at = pos_;
      const std::uint8_t op = p_[pos_++];
      if (op == '.') {  // STOP
        if (stack_size() < 1) fail_("pickle STOP with nothing on the stack (corrupt)");
        return stack_.back();
      }
      if (stack_op(op, at) || container_op(op, at) || scalar_op(op, at) || object_op(op, at)) continue;
      char buf[8];
      std::snprintf(buf, sizeof buf, "0x%02x", op);
      fail_(std::string("unsupported pickle opcode ") + buf + " at byte " + std::to_string(at) +
            " of data.pkl (not written by torch.save, or corrupt)");
    }
  }

  const std::vector<std::unique_ptr<Obj>>& objs() const { return objs_; }
  const Obj& obj(const Value& v) const { return *objs_[static_cast<std::size_t>(v.i)]; }
  const std::string& str(const Value& v) const { return *strs_[static_cast<std::size_t>(v.i)]; }

 private:
  // The protocol, frame, memo and stack opcodes; false for any other.
  bool stack_op(std::uint8_t op, std::size_t at) {
    switch (op) {
      case 0x80: {  // PROTO
        const std::uint8_t v = take(1)[0];
        if (v > 5) fail_("pickle protocol " + std::to_string(v) + " is newer than this reader knows (<= 5)");
        return true;
      }
      case 0x95:
        take(8);
        return true;  // FRAME: a length hint only
      case 'q':
        memo_put(take(1)[0], at);
        return true;  // BINPUT
      case 'r':
        memo_put(u32(take(4)), at);
        return true;  // LONG_BINPUT
      case 0x94:
        memo_put(memo_.size(), at);
        return true;  // MEMOIZE
      case 'h':
        memo_get(take(1)[0], at);
        return true;  // BINGET
      case 'j':
        memo_get(u32(take(4)), at);
        return true;  // LONG_BINGET
      case '2': {     // DUP
        if (stack_size() < 1) underflow(at);
        stack_.push_back(stack_.back());
        return true;
      }
      case '0': {  // POP
        if (stack_size() > 0) {
          pop();
        } else if (!marks_.empty()) {
          marks_.pop_back();  // POP of a bare MARK, as Python's pickle allows
        } else {
          underflow(at);
        }
        return true;
      }
      case '1':
        stack_.resize(pop_mark(at));
        return true;  // POP_MARK
      default:
        return false;
    }
  }

  // The marks, tuples, lists and dicts; false for any other opcode.
  bool container_op(std::uint8_t op, std::size_t at) {
    switch (op) {
      case '(':
        marks_.push_back(stack_.size());
        return true;  // MARK
      case '}':
        push_obj(ObjKind::Dict);
        return true;  // EMPTY_DICT
      case ']':
        push_obj(ObjKind::List);
        return true;  // EMPTY_LIST
      case ')':
        push_obj(ObjKind::Tuple);
        return true;  // EMPTY_TUPLE
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const std::size_t k = op - 0x84u;
        if (stack_size() < k) underflow(at);
        make_tuple(stack_.size() - k);
        return true;
      }
      case 't':
        make_tuple(pop_mark(at));
        return true;  // TUPLE
      case 'l': {     // LIST
        const std::size_t from = pop_mark(at);
        const Value l = new_obj(ObjKind::List);
        obj(l).items.assign(stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
        stack_.resize(from);
        stack_.push_back(l);
        return true;
      }
      case 'd': {  // DICT
        const std::size_t from = pop_mark(at);
        const Value d = new_obj(ObjKind::Dict);
        set_items(d, from, at);
        stack_.push_back(d);
        return true;
      }
      case 's': {  // SETITEM
        if (stack_size() < 3) underflow(at);
        set_items(stack_[stack_.size() - 3], stack_.size() - 2, at);
        return true;
      }
      case 'u': {  // SETITEMS
        const std::size_t from = pop_mark(at);
        set_items(below_mark(from, at), from, at);
        return true;
      }
      case 'a': {  // APPEND
        if (stack_size() < 2) underflow(at);
        append(stack_[stack_.size() - 2], stack_.size() - 1, at);
        return true;
      }
      case 'e': {  // APPENDS
        const std::size_t from = pop_mark(at);
        append(below_mark(from, at), from, at);
        return true;
      }
      default:
        return false;
    }
  }

  // Strings, bytes, numbers, bools and None; false for any other opcode.
  bool scalar_op(std::uint8_t op, std::size_t at) {
    switch (op) {
      case 'X':
        push_str(Kind::Str, u32(take(4)));
        return true;  // BINUNICODE
      case 0x8c:
        push_str(Kind::Str, take(1)[0]);
        return true;  // SHORT_BINUNICODE
      case 0x8d:
        push_str(Kind::Str, u64(take(8)));
        return true;  // BINUNICODE8
      case 'C':
        push_str(Kind::Bytes, take(1)[0]);
        return true;  // SHORT_BINBYTES
      case 'B':
        push_str(Kind::Bytes, u32(take(4)));
        return true;  // BINBYTES
      case 0x8e:
        push_str(Kind::Bytes, u64(take(8)));
        return true;  // BINBYTES8
      case 'J':
        push_int(static_cast<std::int32_t>(u32(take(4))));
        return true;  // BININT
      case 'K':
        push_int(take(1)[0]);
        return true;  // BININT1
      case 'M':
        push_int(u16(take(2)));
        return true;  // BININT2
      case 0x8a:
        push_long(take(1)[0], at);
        return true;  // LONG1
      case 0x8b: {    // LONG4
        const std::uint32_t k = u32(take(4));
        if (static_cast<std::int32_t>(k) < 0)
          fail_("pickle LONG4 with a negative length at byte " + std::to_string(at));
        push_long(k, at);
        return true;
      }
      case 'G': {  // BINFLOAT: big-endian IEEE double
        const std::uint8_t* b = take(8);
        std::uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | b[k];
        Value v;
        v.kind = Kind::Float;
        std::memcpy(&v.f, &bits, 8);
        stack_.push_back(v);
        return true;
      }
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        Value v;
        v.kind = Kind::Bool;
        v.i = op == 0x88;
        stack_.push_back(v);
        return true;
      }
      case 'N':
        stack_.push_back(Value{});
        return true;  // NONE
      default:
        return false;
    }
  }

  // Globals, calls, BUILD and torch's storage references; false for any other opcode.
  bool object_op(std::uint8_t op, std::size_t at) {
    switch (op) {
      case 'c': {  // GLOBAL "module\nname\n"
        const std::string module = line(at), name = line(at);
        push_global(module + "." + name);
        return true;
      }
      case 0x93: {  // STACK_GLOBAL
        if (stack_size() < 2) underflow(at);
        const Value name = pop(), module = pop();
        if (module.kind != Kind::Str || name.kind != Kind::Str)
          fail_("pickle STACK_GLOBAL needs two strings at byte " + std::to_string(at));
        push_global(str(module) + "." + str(name));
        return true;
      }
      case 'R':
      case 0x81: {  // REDUCE f(*args); NEWOBJ cls.__new__(cls, *args)
        if (stack_size() < 2) underflow(at);
        const Value args = pop(), f = pop();
        stack_.push_back(call(f, args, at));
        return true;
      }
      case 'b': {  // BUILD: obj.__setstate__(state)
        if (stack_size() < 2) underflow(at);
        pop();
        const Value target = stack_.back();
        // An OrderedDict's state is its Python attributes (a state_dict's `_metadata`: module
        // versions), a tensor's its Python attributes: neither is content twin reads.
        if (!is_obj(target, ObjKind::Dict) && !is_obj(target, ObjKind::Tensor))
          fail_("pickle BUILD on a " + std::string(kind_name(target, objs_)) + " at byte " + std::to_string(at) +
                " (an arbitrary Python object; twin reads tensors, dicts, lists, tuples, numbers and strings)");
        return true;
      }
      case 'Q': {  // BINPERSID: torch's storage reference
        if (stack_size() < 1) underflow(at);
        stack_.push_back(storage(pop(), at));
        return true;
      }
      default:
        return false;
    }
  }

  Obj& obj(const Value& v) { return *objs_[static_cast<std::size_t>(v.i)]; }
  bool is_obj(const Value& v, ObjKind k) const { return v.kind == Kind::Obj && obj(v).kind == k; }

  const std::uint8_t* take(std::size_t k) {
    if (n_ - pos_ < k) fail_("pickle data.pkl is truncated (an argument runs past its end)");
    const std::uint8_t* r = p_ + pos_;
    pos_ += k;
    return r;
  }

  std::string line(std::size_t at) {
    const void* nl = std::memchr(p_ + pos_, '\n', n_ - pos_);
    if (!nl) fail_("pickle GLOBAL at byte " + std::to_string(at) + " is not terminated");
    const std::size_t len = static_cast<std::size_t>(static_cast<const std::uint8_t*>(nl) - (p_ + pos_));
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len + 1;
    return s;
  }

  // Items above the last mark (the mark itself never is a stack item).
  std::size_t stack_size() const { return stack_.size() - (marks_.empty() ? 0 : marks_.back()); }
  [[noreturn]] void underflow(std::size_t at) const {
    fail_("pickle stack underflow at byte " + std::to_string(at) + " of data.pkl (corrupt)");
  }
  Value pop() {
    const Value v = stack_.back();
    stack_.pop_back();
    return v;
  }
  // The object a SETITEMS/APPENDS fills: the top item of the frame below the popped mark.
  Value below_mark(std::size_t from, std::size_t at) const {
    if (from == 0 || (!marks_.empty() && from - 1 < marks_.back())) underflow(at);
    return stack_[from - 1];
  }
  std::size_t pop_mark(std::size_t at) {
    if (marks_.empty()) fail_("pickle MARK missing at byte " + std::to_string(at) + " of data.pkl (corrupt)");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }

  Value new_obj(ObjKind k) {
    objs_.push_back(std::make_unique<Obj>());
    objs_.back()->kind = k;
    if (k != ObjKind::List && k != ObjKind::Tuple) objs_.back()->x = std::make_unique<Extra>();
    Value v;
    v.kind = Kind::Obj;
    v.i = static_cast<std::int64_t>(objs_.size() - 1);
    return v;
  }
  void push_obj(ObjKind k) { stack_.push_back(new_obj(k)); }

  void make_tuple(std::size_t from) {
    const Value t = new_obj(ObjKind::Tuple);
    obj(t).items.assign(stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
    stack_.push_back(t);
  }

  void push_str(Kind k, std::uint64_t len) {
    const std::uint8_t* b = take(len > n_ ? n_ + 1 : static_cast<std::size_t>(len));  // checked before allocating
    strs_.push_back(std::make_unique<std::string>(reinterpret_cast<const char*>(b), static_cast<std::size_t>(len)));
    Value v;
    v.kind = k;
    v.i = static_cast<std::int64_t>(strs_.size() - 1);
    stack_.push_back(v);
  }

  void push_int(std::int64_t x) {
    Value v;
    v.kind = Kind::Int;
    v.i = x;
    stack_.push_back(v);
  }

  // Little-endian two's complement of k bytes; only what fits in int64 (sizes, counts, metadata).
  void push_long(std::size_t k, std::size_t at) {
    const std::uint8_t* b = take(k);
    if (k > 8)
      fail_("pickle integer of " + std::to_string(k) + " bytes at byte " + std::to_string(at) + " exceeds 64 bits");
    std::uint64_t u = 0;
    for (std::size_t j = 0; j < k; ++j) u |= static_cast<std::uint64_t>(b[j]) << (8 * j);
    if (k > 0 && k < 8 && (b[k - 1] & 0x80)) u |= ~std::uint64_t{0} << (8 * k);  // sign extension
    std::int64_t x;
    std::memcpy(&x, &u, 8);
    push_int(x);
  }

  void push_global(std::string name) {
    const Value g = new_obj(ObjKind::Global);
    obj(g).x->name = std::move(name);
    stack_.push_back(g);
  }

  void memo_put(std::uint64_t key, std::size_t at) {
    if (stack_size() < 1) underflow(at);
    memo_[key] = stack_.back();
  }
  void memo_get(std::uint64_t key, std::size_t at) {
    const auto it = memo_.find(key);
    if (it == memo_.end())
      fail_("pickle memo " + std::to_string(key) + " read before written at byte " + std::to_string(at));
    stack_.push_back(it->second);
  }

  // dict[k] = v for the pairs stack_[from..]; Python semantics: a repeated key keeps its position.
  void set_items(const Value& target, std::size_t from, std::size_t at) {
    if (!is_obj(target, ObjKind::Dict))
      fail_("pickle SETITEM on a " + std::string(kind_name(target, objs_)) + " at byte " + std::to_string(at));
    if ((stack_.size() - from) % 2) fail_("pickle SETITEMS with an odd number of items at byte " + std::to_string(at));
    Obj& d = obj(target);
    Extra& dx = *d.x;
    for (std::size_t k = from; k < stack_.size(); k += 2) {
      const Value key = stack_[k], val = stack_[k + 1];
      std::size_t* slot = nullptr;
      std::size_t fresh = d.items.size();
      if (key.kind == Kind::Str) {
        slot = &dx.str_index.emplace(str(key), fresh).first->second;
      } else if (key.kind == Kind::Int || key.kind == Kind::Bool) {
        slot = &dx.int_index.emplace(key.i, fresh).first->second;
      }
      if (slot && *slot != fresh) {
        d.items[*slot] = val;
      } else {
        dx.keys.push_back(key);
        d.items.push_back(val);
      }
    }
    stack_.resize(from);
  }

  void append(const Value& target, std::size_t from, std::size_t at) {
    if (!is_obj(target, ObjKind::List))
      fail_("pickle APPEND on a " + std::string(kind_name(target, objs_)) + " at byte " + std::to_string(at));
    Obj& l = obj(target);
    l.items.insert(l.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
  }

  std::string global_name(const Value& v) const { return is_obj(v, ObjKind::Global) ? obj(v).x->name : ""; }

  const std::vector<Value>& tuple_items(const Value& args, const std::string& what, std::size_t at) const {
    if (!is_obj(args, ObjKind::Tuple))
      fail_(what + " called with a " + kind_name(args, objs_) + ", not a tuple, at byte " + std::to_string(at));
    return obj(args).items;
  }

  std::int64_t int_arg(const Value& v, const std::string& what) const {
    if (v.kind != Kind::Int) fail_(what + " is a " + kind_name(v, objs_) + ", not an int");
    return v.i;
  }

  std::vector<std::int64_t> int_tuple(const Value& v, const std::string& what) const {
    if (!is_obj(v, ObjKind::Tuple) && !is_obj(v, ObjKind::List))
      fail_(what + " is a " + kind_name(v, objs_) + ", not a tuple");
    const auto& items = obj(v).items;
    if (items.size() > kMaxRank) fail_(what + " has " + std::to_string(items.size()) + " dimensions (at most 64)");
    std::vector<std::int64_t> r;
    for (const Value& x : items) r.push_back(int_arg(x, what + " entry"));
    return r;
  }

  // The callables torch.save's pickles use; anything else is an object twin does not read.
  Value call(const Value& f, const Value& args, std::size_t at) {
    const std::string fn = global_name(f);
    if (fn.empty())
      fail_("pickle REDUCE calls a " + std::string(kind_name(f, objs_)) + " at byte " + std::to_string(at));
    const auto& a = tuple_items(args, fn, at);
    if (fn == "collections.OrderedDict") {
      if (!a.empty()) fail_("collections.OrderedDict called with arguments at byte " + std::to_string(at));
      return new_obj(ObjKind::Dict);
    }
    if (fn == "torch._utils._rebuild_tensor_v2" || fn == "torch._utils._rebuild_tensor" ||
        fn == "torch._utils._rebuild_tensor_v3") {
      // (storage, storage_offset, size, stride[, requires_grad, backward_hooks[, dtype][, metadata]])
      const bool v3 = fn == "torch._utils._rebuild_tensor_v3";
      if (a.size() < (v3 ? 7u : 4u) || a.size() > (v3 ? 8u : 7u))
        fail_(fn + " called with " + std::to_string(a.size()) + " arguments at byte " + std::to_string(at));
      if (!is_obj(a[0], ObjKind::Storage))
        fail_(fn + " at byte " + std::to_string(at) + " gets a " + kind_name(a[0], objs_) + ", not a storage");
      const Value t = new_obj(ObjKind::Tensor);
      Extra& o = *obj(t).x;
      o.storage = static_cast<std::size_t>(a[0].i);
      o.elem = obj(a[0]).x->elem;
      if (v3) {
        const std::string dt = global_name(a[6]);
        const auto e = dtype_elem(dt);
        if (!e)
          fail_(fn + " at byte " + std::to_string(at) + ": dtype " + (dt.empty() ? "?" : dt) +
                " is not one twin reads (F64, F32, BF16, F16, I64, I32, BOOL)");
        o.elem = *e;
      }
      o.offset = int_arg(a[1], "tensor storage offset");
      o.sizes = int_tuple(a[2], "tensor size");
      o.strides = int_tuple(a[3], "tensor stride");
      if (o.sizes.size() != o.strides.size())
        fail_("tensor at byte " + std::to_string(at) + " has " + std::to_string(o.sizes.size()) + " sizes but " +
              std::to_string(o.strides.size()) + " strides");
      return t;
    }
    if (fn == "torch._utils._rebuild_parameter" || fn == "torch._utils._rebuild_parameter_with_state") {
      if (a.empty() || !is_obj(a[0], ObjKind::Tensor))
        fail_(fn + " at byte " + std::to_string(at) + " does not wrap a tensor");
      return a[0];
    }
    if (fn == "torch._tensor._rebuild_from_type_v2") {
      // (func, type, args, state): a tensor with Python attributes; the type must be a plain one.
      if (a.size() != 4)
        fail_(fn + " called with " + std::to_string(a.size()) + " arguments at byte " + std::to_string(at));
      const std::string type = global_name(a[1]);
      if (type != "torch.Tensor" && type != "torch.nn.parameter.Parameter")
        fail_("tensor subclass " + (type.empty() ? std::string("?") : type) + " at byte " + std::to_string(at) +
              " is unsupported");
      const std::string inner = global_name(a[0]);
      if (inner == fn) fail_(fn + " nested in itself at byte " + std::to_string(at));
      return call(a[0], a[2], at);
    }
    if (fn == "torch.jit._pickle.restore_type_tag") {
      // LibTorch's writer (torch::jit::pickle_save) tags typed containers: (value, "Dict[str, Tensor]").
      if (a.empty()) fail_(fn + " called without arguments at byte " + std::to_string(at));
      return a[0];
    }
    if (fn == "torch.Size" || fn == "builtins.tuple" || fn == "__builtin__.tuple") {
      if (a.size() == 1 && (is_obj(a[0], ObjKind::Tuple) || is_obj(a[0], ObjKind::List))) {
        const Value t = new_obj(ObjKind::Tuple);
        obj(t).items = obj(a[0]).items;
        return t;
      }
    }
    if (fn == "torch.device" && !a.empty() && a[0].kind == Kind::Str) {
      // A device as metadata: its text, as str(torch.device(...)) prints it.
      std::string s = str(a[0]);
      if (a.size() == 2 && a[1].kind == Kind::Int) s += ":" + std::to_string(a[1].i);
      strs_.push_back(std::make_unique<std::string>(std::move(s)));
      Value v;
      v.kind = Kind::Str;
      v.i = static_cast<std::int64_t>(strs_.size() - 1);
      return v;
    }
    if (fn == "torch.serialization._get_layout" && a.size() == 1 && a[0].kind == Kind::Str) {
      const Value g = new_obj(ObjKind::Global);
      obj(g).x->name = str(a[0]);
      return g;
    }
    fail_("unsupported Python object " + quoted(fn) + " at byte " + std::to_string(at) +
          " (twin reads tensors, dicts, lists, tuples, numbers and strings)");
  }

  // ('storage', torch.<X>Storage, key, location, numel) -> a Storage object.
  Value storage(const Value& pid, std::size_t at) {
    const std::string where = " at byte " + std::to_string(at);
    if (!is_obj(pid, ObjKind::Tuple) || obj(pid).items.size() != 5)
      fail_("persistent id" + where + " is not torch's ('storage', type, key, location, numel)");
    const auto& t = obj(pid).items;
    if (t[0].kind != Kind::Str || str(t[0]) != "storage") fail_("persistent id" + where + " is not a storage");
    const std::string type = global_name(t[1]);
    const auto elem = storage_elem(type);
    if (!elem) fail_("storage type " + quoted(type.empty() ? kind_name(t[1], objs_) : type) + where + " is unknown");
    if (t[2].kind != Kind::Str) fail_("storage key" + where + " is not a string");
    const std::int64_t numel = int_arg(t[4], "storage size");
    if (numel < 0) fail_("storage " + quoted(str(t[2])) + " has a negative size " + std::to_string(numel));
    const Value s = new_obj(ObjKind::Storage);
    Extra& o = *obj(s).x;
    o.name = str(t[2]);
    o.elem = *elem;
    o.numel = numel;
    return s;
  }

  const Fail& fail_;
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t pos_ = 0;
  std::vector<Value> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, Value> memo_;
  std::vector<std::unique_ptr<Obj>> objs_;
  std::vector<std::unique_ptr<std::string>> strs_;  // stable addresses: dict indexes view them
};

// ---- flattening into TorchFile -----------------------------------------------------------------

class Flattener {
 public:
  Flattener(const Fail& fail, const Zip& zip, const Unpickler& u, std::string prefix, bool big_endian,
            std::size_t input_size)
      : fail_(fail),
        zip_(zip),
        u_(u),
        prefix_(std::move(prefix)),
        big_endian_(big_endian),
        budget_(input_size > (SIZE_MAX - (std::size_t{64} << 20)) / 16 ? SIZE_MAX
                                                                       : 16 * input_size + (std::size_t{64} << 20)) {}

  void run(const std::string& name, const Value& v, TorchFile& out, int depth) {
    const std::string key = name.empty() ? "tensor" : name;
    if (depth > kMaxDepth)
      fail_("'" + key.substr(0, 200) + "': containers nested deeper than " + std::to_string(kMaxDepth) +
            " levels (or a container that contains itself)");
    if (key.size() > kMaxName) fail_("a flattened name is longer than " + std::to_string(kMaxName) + " characters");
    spend(key.size() + 64);
    const auto child = [&](const std::string& k) { return name.empty() ? k : name + "." + k; };
    switch (v.kind) {
      case Kind::None:
        put_meta(out, key, "None");
        return;
      case Kind::Bool:
        put_meta(out, key, v.i ? "True" : "False");
        return;
      case Kind::Int:
        put_meta(out, key, std::to_string(v.i));
        return;
      case Kind::Float:
        put_meta(out, key, float_repr(v.f));
        return;
      case Kind::Str:
        put_meta(out, key, u_.str(v));
        return;
      case Kind::Bytes:
        put_meta(out, key, "<" + std::to_string(u_.str(v).size()) + " bytes>");
        return;
      case Kind::Obj:
        break;
    }
    const Obj& o = u_.obj(v);
    switch (o.kind) {
      case ObjKind::Dict:
        for (std::size_t k = 0; k < o.items.size(); ++k)
          run(child(key_text(o.x->keys[k], key)), o.items[k], out, depth + 1);
        return;
      case ObjKind::List:
      case ObjKind::Tuple:
        for (std::size_t k = 0; k < o.items.size(); ++k) run(child(std::to_string(k)), o.items[k], out, depth + 1);
        return;
      case ObjKind::Global:
        put_meta(out, key, o.x->name);
        return;  // e.g. a dtype: torch.float32
      case ObjKind::Storage:
        fail_("'" + key + "' is a bare storage, not a tensor");
      case ObjKind::Tensor:
        out.tensors.emplace_back(key, tensor(key, *o.x));
        return;
    }
  }

 private:
  void spend(std::size_t bytes) {
    if (bytes > budget_)
      fail_(
          "the flattened contents exceed 16 times the file's size plus 64 MiB (a pickle that repeats "
          "references to the same objects, or a huge expanded view)");
    budget_ -= bytes;
  }

  void put_meta(TorchFile& out, const std::string& key, std::string text) {
    spend(text.size());
    out.metadata[key] = std::move(text);
  }

  std::string key_text(const Value& k, const std::string& where) const {
    switch (k.kind) {
      case Kind::Str:
        return u_.str(k);
      case Kind::Int:
        return std::to_string(k.i);
      case Kind::Bool:
        return k.i ? "True" : "False";
      case Kind::None:
        return "None";
      case Kind::Float:
        return float_repr(k.f);
      default:
        break;
    }
    fail_("a dict key in '" + where + "' is a " + kind_name(k, u_.objs()) + ", not a string or number");
  }

  Tensor tensor(const std::string& key, const Extra& t) {
    const Extra& s = *u_.objs()[t.storage]->x;
    const std::string what = "tensor '" + key + "'";
    if (!t.elem.dtype)
      fail_(what + " has dtype " + std::string(t.elem.torch_name) +
            ", which twin does not read (F64, F32, BF16, F16, I64, I32, BOOL)");
    const std::size_t es = t.elem.size;
    // The storage's bytes, as its persistent id describes them.
    std::uint64_t storage_bytes = 0;
    if (__builtin_mul_overflow(static_cast<std::uint64_t>(s.numel), static_cast<std::uint64_t>(s.elem.size),
                               &storage_bytes))
      fail_("storage " + quoted(s.name) + " of " + what + " has an overflowing size");
    const auto [data, have] = zip_.read(prefix_ + "/data/" + s.name);
    if (have < storage_bytes)
      fail_("storage " + quoted(s.name) + " of " + what + " holds " + std::to_string(have) +
            " bytes, its header says " + std::to_string(storage_bytes));
    const std::uint64_t elems = storage_bytes / es;
    // The view: sizes and strides in elements from the offset; every index must fall inside.
    if (t.offset < 0) fail_(what + " has a negative storage offset " + std::to_string(t.offset));
    std::uint64_t numel = 1, last = static_cast<std::uint64_t>(t.offset);
    bool overflow = false;
    for (std::size_t d = 0; d < t.sizes.size(); ++d) {
      if (t.sizes[d] < 0)
        fail_(what + " has a negative size " + std::to_string(t.sizes[d]) + " in dimension " + std::to_string(d));
      if (t.strides[d] < 0)
        fail_(what + " has a negative stride " + std::to_string(t.strides[d]) + " in dimension " + std::to_string(d));
      overflow |= __builtin_mul_overflow(numel, static_cast<std::uint64_t>(t.sizes[d]), &numel);
    }
    if (overflow || numel > static_cast<std::uint64_t>(INT64_MAX) / 16)
      fail_(what + " has sizes " + shape_str(t.sizes) + " whose element count overflows");
    if (numel > 0) {
      for (std::size_t d = 0; d < t.sizes.size(); ++d) {
        std::uint64_t reach = 0;
        overflow |= __builtin_mul_overflow(static_cast<std::uint64_t>(t.sizes[d] - 1),
                                           static_cast<std::uint64_t>(t.strides[d]), &reach);
        overflow |= __builtin_add_overflow(last, reach, &last);
      }
      if (overflow || last >= elems)
        fail_(what + " (size " + shape_str(t.sizes) + ", stride " + shape_str(t.strides) + ", offset " +
              std::to_string(t.offset) + ") needs more than the " + std::to_string(elems) + " elements of storage " +
              quoted(s.name));
    }
    spend(static_cast<std::size_t>(numel) * es);
    Tensor r = Tensor::empty(*t.elem.dtype, t.sizes);
    std::uint8_t* out = reinterpret_cast<std::uint8_t*>(r.raw_mut());
    if (numel > 0) copy_view(out, data, t, es);
    if (big_endian_ && es > 1)
      for (std::uint64_t k = 0; k < numel; ++k) std::reverse(out + k * es, out + (k + 1) * es);
    // A bool must be 0 or 1 (any other byte is undefined behaviour when read as bool).
    if (*t.elem.dtype == DType::BOOL)
      for (std::uint64_t k = 0; k < numel; ++k) out[k] = out[k] != 0;
    return r;
  }

  // Gathers a strided view into contiguous row-major bytes, one innermost row per memcpy when the
  // innermost stride is 1. Bounds were checked by the caller.
  static void copy_view(std::uint8_t* out, const std::uint8_t* data, const Extra& t, std::size_t es) {
    const std::size_t rank = t.sizes.size();
    if (rank == 0) {
      std::memcpy(out, data + static_cast<std::size_t>(t.offset) * es, es);
      return;
    }
    const std::size_t inner = static_cast<std::size_t>(t.sizes[rank - 1]);
    const std::size_t inner_stride = static_cast<std::size_t>(t.strides[rank - 1]);
    std::vector<std::int64_t> idx(rank, 0);
    while (true) {
      std::size_t base = static_cast<std::size_t>(t.offset);
      for (std::size_t d = 0; d + 1 < rank; ++d) base += static_cast<std::size_t>(idx[d] * t.strides[d]);
      if (inner_stride == 1) {
        std::memcpy(out, data + base * es, inner * es);
        out += inner * es;
      } else {
        for (std::size_t k = 0; k < inner; ++k, out += es) std::memcpy(out, data + (base + k * inner_stride) * es, es);
      }
      std::size_t d = rank - 1;
      while (d > 0) {
        if (++idx[d - 1] < t.sizes[d - 1]) break;
        idx[d - 1] = 0;
        --d;
      }
      if (d == 0) return;
    }
  }

  const Fail& fail_;
  const Zip& zip_;
  const Unpickler& u_;
  std::string prefix_;
  bool big_endian_;
  std::size_t budget_;
};

}  // namespace

TorchFile read_torch_bytes(const std::string& name, const std::uint8_t* data, std::size_t size) {
  const Fail fail(name);
  if (size < 4 || std::memcmp(data, "PK\x03\x04", 4) != 0)
    fail("not a torch.save zip archive (legacy pre-1.6 or non-PyTorch file); re-save it with torch.save");
  const Zip zip(fail, data, size);
  // The pickle is <archive>/data.pkl; <archive> is the file's stem when torch.save wrote it.
  std::optional<std::string> found;
  for (const auto& [entry, z] : zip.entries()) {
    const std::size_t slash = entry.find('/');
    if (slash != std::string::npos && entry.compare(slash, std::string::npos, "/data.pkl") == 0) {
      found = entry.substr(0, slash);
      break;
    }
  }
  if (!found) fail("zip archive has no <archive>/data.pkl: not written by torch.save");
  const std::string prefix = *found;
  if (zip.has(prefix + "/constants.pkl"))
    fail("a TorchScript archive (torch.jit.save), not a torch.save file; twin reads torch.save files");
  bool big_endian = false;
  if (zip.has(prefix + "/byteorder")) {
    const auto [p, n] = zip.read(prefix + "/byteorder");
    const std::string order(reinterpret_cast<const char*>(p), n);
    if (order == "big") {
      big_endian = true;
    } else if (order != "little") {
      fail("byteorder entry says " + quoted(order) + ", not 'little' or 'big'");
    }
  }
  const auto [pkl, pkl_size] = zip.read(prefix + "/data.pkl");
  Unpickler u(fail, pkl, pkl_size);
  const Value root = u.run();
  TorchFile f;
  f.path = name;
  Flattener(fail, zip, u, prefix, big_endian, size).run("", root, f, 0);
  return f;
}

TorchFile read_torch_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw TorchFileError(path + ": cannot open: " + std::strerror(errno));
  const std::streamoff size = in.tellg();
  if (size < 0) throw TorchFileError(path + ": cannot read its size");
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) throw TorchFileError(path + ": read failed");
  return read_torch_bytes(path, bytes.data(), bytes.size());
}

}  // namespace twin
