// What the processes of a layer run as processes (rank_runner.h) send each other on the host: each
// phase's outcome, and the host values a rank records in its phase (its taps' parts, its output
// and record, its token counts), so every process holds every rank's, as the threaded ranks leave
// them in one process. Values travel as their bytes in host order (the processes of one launch run
// one build on one kind of machine).
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "core/record.h"
#include "core/rounding.h"
#include "optimized/layer/options.h"      // LayerOutput
#include "optimized/layer/rank_runner.h"  // RankTap
#include "optimized/runtime/processes.h"

namespace twin::opt {

// How one rank's phase ended, and its rounding count at the end.
struct RankOutcome {
  enum class Kind : std::uint8_t { Ok, Config, Shape, InvalidArgument, Logic, Collective, Runtime };
  Kind kind = Kind::Ok;
  std::string message;
  RoundingCount rounding;
  static RankOutcome of(std::exception_ptr e);
};
// Every rank's outcome, in rank order (a collective of the processes).
std::vector<RankOutcome> exchange_outcomes(const RankOutcome& mine);
// Throws, on every process alike, the failure of the first rank that failed other than by waiting
// in a collective (a rank left waiting by a failed one fails at the deadline), of its exception
// type; its message names the rank unless every rank failed alike.
void rethrow_first_failure(const std::vector<RankOutcome>& all);

// Byte streams of host values.
struct Writer {
  rt::Bytes out;
  void raw(const void* p, std::size_t n);
  template <class T>
  void pod(const T& v) {
    raw(&v, sizeof v);
  }
};
struct Reader {
  const rt::Bytes& in;
  std::size_t at = 0;
  void raw(void* p, std::size_t n);
  template <class T>
  T pod() {
    T v;
    raw(&v, sizeof v);
    return v;
  }
};
void write(Writer& w, const std::string& s);
void write(Writer& w, const Tensor& t);
void write(Writer& w, const RankTap& t);
void write(Writer& w, const Record& r);
void write(Writer& w, const LayerOutput& o);
void write(Writer& w, std::int64_t v);
template <class T>
void write(Writer& w, const std::vector<T>& v) {
  w.pod(std::uint64_t(v.size()));
  for (const T& x : v) write(w, x);
}
void read(Reader& r, std::string& s);
void read(Reader& r, Tensor& t);
void read(Reader& r, RankTap& t);
void read(Reader& r, Record& rec);
void read(Reader& r, LayerOutput& o);
void read(Reader& r, std::int64_t& v);
template <class T>
void read(Reader& r, std::vector<T>& v) {
  v.resize(std::size_t(r.pod<std::uint64_t>()));
  for (T& x : v) read(r, x);
}

// With processes: each process's own rank's per_rank[rank] sent to every other, so afterwards
// per_rank[r] is rank r's on every process (a collective). A no-op with threads.
template <class T>
void share_ranks(std::vector<T>& per_rank, bool processes) {
  if (!processes) return;
  Writer w;
  write(w, per_rank.at(static_cast<std::size_t>(rt::process_rank())));
  const std::vector<rt::Bytes> all = rt::process_allgather(w.out);
  for (std::size_t q = 0; q < all.size(); ++q) {
    Reader r{all[q]};
    read(r, per_rank.at(q));
  }
}

}  // namespace twin::opt
