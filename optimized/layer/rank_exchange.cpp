#include "optimized/layer/rank_exchange.h"

#include <cstring>
#include <stdexcept>

#include "core/config.h"

namespace twin::opt {

// ---- outcomes --------------------------------------------------------------------------------------
RankOutcome RankOutcome::of(std::exception_ptr e) {
  RankOutcome o;
  auto set = [&o](Kind kind, const char* message) {
    o.kind = kind;
    o.message = message;
  };
  try {
    std::rethrow_exception(e);
  } catch (const ConfigError& x) {
    set(Kind::Config, x.what());
  } catch (const ShapeError& x) {
    set(Kind::Shape, x.what());
  } catch (const rt::CollectiveError& x) {
    set(Kind::Collective, x.what());
  } catch (const std::invalid_argument& x) {
    set(Kind::InvalidArgument, x.what());
  } catch (const std::logic_error& x) {
    set(Kind::Logic, x.what());
  } catch (const std::exception& x) {
    set(Kind::Runtime, x.what());
  } catch (...) {
    set(Kind::Runtime, "an exception that is not a std::exception");
  }
  return o;
}

std::vector<RankOutcome> exchange_outcomes(const RankOutcome& mine) {
  Writer w;
  w.pod(mine.kind);
  write(w, mine.message);
  w.pod(mine.rounding);
  std::vector<RankOutcome> all;
  for (const rt::Bytes& b : rt::process_allgather_control(w.out)) {
    Reader r{b};
    RankOutcome o;
    o.kind = r.pod<RankOutcome::Kind>();
    read(r, o.message);
    o.rounding = r.pod<RoundingCount>();
    all.push_back(std::move(o));
  }
  return all;
}

void rethrow_first_failure(const std::vector<RankOutcome>& all) {
  using Kind = RankOutcome::Kind;
  int first = -1;
  bool alike = true;
  for (std::size_t r = 0; r < all.size(); ++r) {
    alike = alike && all[r].kind == all[0].kind && all[r].message == all[0].message;
    if (all[r].kind == Kind::Ok) continue;
    if (first < 0 || (all[std::size_t(first)].kind == Kind::Collective && all[r].kind != Kind::Collective))
      first = int(r);
  }
  if (first < 0) return;
  const RankOutcome& o = all[std::size_t(first)];
  const std::string msg = alike ? o.message : "rank " + std::to_string(first) + " failed: " + o.message;
  switch (o.kind) {
    case Kind::Config:
      throw ConfigError(msg);
    case Kind::Shape:
      throw ShapeError(msg);
    case Kind::InvalidArgument:
      throw std::invalid_argument(msg);
    case Kind::Logic:
      throw std::logic_error(msg);
    case Kind::Collective:
      throw rt::CollectiveError(msg);
    default:
      throw std::runtime_error(msg);
  }
}

// ---- byte streams ----------------------------------------------------------------------------------
void Writer::raw(const void* p, std::size_t n) {
  const char* c = static_cast<const char*>(p);
  out.insert(out.end(), c, c + n);
}

void Reader::raw(void* p, std::size_t n) {
  if (at + n > in.size()) throw std::logic_error("rank exchange: a message ends before its values do");
  std::memcpy(p, in.data() + at, n);
  at += n;
}

void write(Writer& w, const std::string& s) {
  w.pod(std::uint64_t(s.size()));
  w.raw(s.data(), s.size());
}
void read(Reader& r, std::string& s) {
  s.resize(std::size_t(r.pod<std::uint64_t>()));
  r.raw(s.data(), s.size());
}

void write(Writer& w, std::int64_t v) { w.pod(v); }
void read(Reader& r, std::int64_t& v) { v = r.pod<std::int64_t>(); }

// Undefined, or dtype, shape and bytes.
void write(Writer& w, const Tensor& t) {
  w.pod(t.defined());
  if (!t.defined()) return;
  w.pod(t.dtype());
  write(w, t.shape());
  w.raw(t.raw(), t.nbytes());
}
void read(Reader& r, Tensor& t) {
  if (!r.pod<bool>()) {
    t = Tensor();
    return;
  }
  const DType dt = r.pod<DType>();
  Shape shape;
  read(r, shape);
  t = Tensor::empty(dt, std::move(shape));
  r.raw(t.raw_mut(), t.nbytes());
}

void write(Writer& w, const RankTap& t) {
  write(w, t.name);
  write(w, t.value);
  w.pod(t.rounding);
  w.pod(t.layout);
  write(w, t.block_magnitude);
}
void read(Reader& r, RankTap& t) {
  read(r, t.name);
  read(r, t.value);
  t.rounding = r.pod<RoundingCount>();
  t.layout = r.pod<ShardLayout>();
  read(r, t.block_magnitude);
}

// Every entry's data; a cell's display rule (a function) cannot travel, and no layer records one.
void write(Writer& w, const Record& rec) {
  w.pod(std::uint64_t(rec.entries.size()));
  for (const RecordEntry& e : rec.entries) {
    if (e.show) throw std::logic_error("rank exchange: entry '" + e.name + "' has a display rule, which cannot travel");
    w.pod(e.role);
    write(w, e.name);
    write(w, e.value);
    w.pod(e.rounding);
    w.pod(e.magnitude);
    write(w, e.block_magnitude);
    write(w, e.row_labels);
  }
  w.pod(std::uint64_t(rec.calls.size()));
  for (const auto& [path, n] : rec.calls) {
    write(w, path);
    w.pod(n);
  }
}
void read(Reader& r, Record& rec) {
  rec = Record{};
  rec.entries.resize(std::size_t(r.pod<std::uint64_t>()));
  for (RecordEntry& e : rec.entries) {
    e.role = r.pod<Role>();
    read(r, e.name);
    read(r, e.value);
    e.rounding = r.pod<RoundingCount>();
    e.magnitude = r.pod<double>();
    read(r, e.block_magnitude);
    read(r, e.row_labels);
  }
  for (auto n = r.pod<std::uint64_t>(); n > 0; --n) {
    std::string path;
    read(r, path);
    rec.calls[path] = r.pod<int>();
  }
}

void write(Writer& w, const LayerOutput& o) {
  write(w, o.hidden_states);
  write(w, o.record);
}
void read(Reader& r, LayerOutput& o) {
  read(r, o.hidden_states);
  read(r, o.record);
}

}  // namespace twin::opt
