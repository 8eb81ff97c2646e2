// collectives_threaded.cpp: simulated ranks as threads of one process.
//
// Design: each collective is two rendezvous of all ranks. At the first, every rank has posted its
// arguments (pointers, counts, dtype, root) in its slot; each rank then checks that the slots agree
// (the check reads every slot, so all ranks reach the same verdict) and computes ITS output into a
// private buffer, reading the other ranks' send buffers directly. At the second rendezvous every
// rank has finished reading, so each copies its private result into recv; this makes in-place
// calls (send == recv, or overlapping) safe. Sums run in rank order with one rounding to the dtype
// per addition.
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/collectives_internal.h"
#include "optimized/runtime/sim_stream.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

namespace twin::rt {
namespace {

struct Slot {
  const char* op = nullptr;
  const void* send = nullptr;
  std::size_t count = 0;
  DType dt = DType::F32;
  int root = 0;
  const std::vector<std::size_t>* send_counts = nullptr;
  const std::vector<std::size_t>* recv_counts = nullptr;
};

struct Group {
  explicit Group(int n) : n(n), slots(n), arrived_at(n, 0) {}
  const int n;
  std::mutex m;
  std::condition_variable cv;
  std::vector<Slot> slots;
  std::vector<std::uint64_t> arrived_at;  // per rank: the last rendezvous number it reached
  std::uint64_t generation = 0;
  int arrived = 0;
  bool aborted = false;
  std::string abort_reason;

  // All ranks meet; throws (on every rank) when the group was aborted or a rank times out.
  void rendezvous(int rank, const char* what) {
    std::unique_lock<std::mutex> lock(m);
    if (aborted) throw CollectiveError(abort_reason);
    const std::uint64_t gen = generation;
    arrived_at[rank] = gen + 1;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(collective_timeout_seconds());
    while (generation == gen && !aborted) {
      if (cv.wait_until(lock, deadline) == std::cv_status::timeout && generation == gen && !aborted) {
        std::string missing;
        for (int r = 0; r < n; ++r)
          if (arrived_at[r] != gen + 1) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        aborted = true;
        abort_reason = std::string("threaded collectives: rank ") + std::to_string(rank) + " waited " +
                       std::to_string(collective_timeout_seconds()) + " s in " + what + " for rank(s) " + missing +
                       ", which never arrived; the group is aborted";
        cv.notify_all();
      }
    }
    if (aborted) throw CollectiveError(abort_reason);
  }
};

template <class T>
void sum_into(T* acc, const T* x, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) acc[i] = acc[i] + x[i];
}

}  // namespace

double collective_timeout_seconds() {
  if (const char* s = std::getenv("TWIN_COLLECTIVE_TIMEOUT_S"); s && *s) return std::atof(s);
  return 60.0;
}

void add_rounded(DType dt, void* acc, const void* x, std::size_t count) {
  switch (dt) {
    case DType::F32:
      sum_into(static_cast<float*>(acc), static_cast<const float*>(x), count);
      break;
    case DType::F64:
      sum_into(static_cast<double*>(acc), static_cast<const double*>(x), count);
      break;
    case DType::I32:
      sum_into(static_cast<std::int32_t*>(acc), static_cast<const std::int32_t*>(x), count);
      break;
    case DType::I64:
      sum_into(static_cast<std::int64_t*>(acc), static_cast<const std::int64_t*>(x), count);
      break;
    case DType::BF16: {
      auto* a = static_cast<std::uint16_t*>(acc);
      auto* b = static_cast<const std::uint16_t*>(x);
      for (std::size_t i = 0; i < count; ++i)
        a[i] = float_to_bf16_bits(bf16_bits_to_float(a[i]) + bf16_bits_to_float(b[i]));
      break;
    }
    case DType::F16: {
      auto* a = static_cast<std::uint16_t*>(acc);
      auto* b = static_cast<const std::uint16_t*>(x);
      for (std::size_t i = 0; i < count; ++i)
        a[i] = float_to_fp16_bits(fp16_bits_to_float(a[i]) + fp16_bits_to_float(b[i]));
      break;
    }
    default:
      throw CollectiveError(std::string("collectives: cannot sum dtype ") + dtype_name(dt));
  }
}

namespace {

class ThreadedComm final : public Communicator {
 public:
  ThreadedComm(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->n; }
  Backend backend() const override { return Backend::Sim; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    run(s, Slot{"all_reduce", send, count, dt}, recv, [this, count, dt](std::vector<char>& out) {
      const std::size_t bytes = count * dtype_size(dt);
      out.resize(bytes);
      if (bytes) std::memcpy(out.data(), g_->slots[0].send, bytes);
      for (int r = 1; r < g_->n; ++r) add_rounded(dt, out.data(), g_->slots[r].send, count);
    });
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    run(s, Slot{"all_gather", send, count, dt}, recv, [this, count, dt](std::vector<char>& out) {
      const std::size_t bytes = count * dtype_size(dt);
      out.resize(bytes * g_->n);
      for (int r = 0; r < g_->n; ++r)
        if (bytes) std::memcpy(out.data() + r * bytes, g_->slots[r].send, bytes);
    });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    run(s, Slot{"reduce_scatter", send, count, dt}, recv, [this, count, dt](std::vector<char>& out) {
      const std::size_t bytes = count * dtype_size(dt);
      out.resize(bytes);
      auto part = [&](int r) { return static_cast<const char*>(g_->slots[r].send) + rank_ * bytes; };
      if (bytes) std::memcpy(out.data(), part(0), bytes);
      for (int r = 1; r < g_->n; ++r) add_rounded(dt, out.data(), part(r), count);
    });
  }
  void all_to_all(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                  const std::vector<std::size_t>& recv_counts, DType dt, cudaStream_t s) override {
    const std::size_t n = static_cast<std::size_t>(g_->n);
    if (send_counts.size() != n || recv_counts.size() != n)
      throw CollectiveError("threaded all_to_all (rank " + std::to_string(rank_) + "): send_counts has " +
                            std::to_string(send_counts.size()) + " and recv_counts " +
                            std::to_string(recv_counts.size()) + " entries; the group has " + std::to_string(n) +
                            " ranks");
    // The counts are copied: the call may be recorded into a graph and replayed later.
    auto sc = std::make_shared<std::vector<std::size_t>>(send_counts);
    auto rc = std::make_shared<std::vector<std::size_t>>(recv_counts);
    std::size_t total = 0;
    for (auto c : recv_counts) total += c;
    Slot slot{"all_to_all", send, total, dt};
    cudasim::detail::enqueue(s, [this, slot, sc, rc, recv, dt]() mutable {
      slot.send_counts = sc.get();
      slot.recv_counts = rc.get();
      execute(slot, recv, [this, dt](std::vector<char>& out) {
        const std::size_t es = dtype_size(dt);
        std::size_t total_bytes = 0;
        for (auto c : *g_->slots[rank_].recv_counts) total_bytes += c * es;
        out.resize(total_bytes);
        std::size_t off = 0;
        for (int q = 0; q < g_->n; ++q) {
          const Slot& src = g_->slots[q];
          std::size_t src_off = 0;  // where rank q's part for us starts in its send buffer
          for (int p = 0; p < rank_; ++p) src_off += (*src.send_counts)[p] * es;
          const std::size_t bytes = (*src.send_counts)[rank_] * es;
          if (bytes) std::memcpy(out.data() + off, static_cast<const char*>(src.send) + src_off, bytes);
          off += bytes;
        }
      });
    });
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dt, int root, cudaStream_t s) override {
    if (root < 0 || root >= g_->n)
      throw CollectiveError("threaded broadcast: root " + std::to_string(root) + " is not a rank of a group of " +
                            std::to_string(g_->n));
    Slot slot{"broadcast", send, count, dt};
    slot.root = root;
    run(s, slot, recv, [this, count, dt, root](std::vector<char>& out) {
      const std::size_t bytes = count * dtype_size(dt);
      out.resize(bytes);
      if (bytes) std::memcpy(out.data(), g_->slots[root].send, bytes);
    });
  }

 private:
  template <class F>
  void run(cudaStream_t s, Slot slot, void* recv, F compute) {
    cudasim::detail::enqueue(s, [this, slot, recv, compute] { execute(slot, recv, compute); });
  }

  // Throws on every rank alike when the slots disagree (each rank evaluates all slots).
  void check_agreement() {
    const Slot& a = g_->slots[0];
    for (int r = 1; r < g_->n; ++r) {
      const Slot& b = g_->slots[r];
      auto mismatch = [&](const std::string& what) {
        throw CollectiveError(std::string("threaded collectives: ranks disagree: rank 0 calls ") + a.op + ", rank " +
                              std::to_string(r) + " calls " + b.op + ": " + what);
      };
      if (std::strcmp(a.op, b.op) != 0) mismatch("different collectives");
      if (a.dt != b.dt) mismatch(std::string("dtype ") + dtype_name(a.dt) + " vs " + dtype_name(b.dt));
      if (std::strcmp(a.op, "all_to_all") != 0 && a.count != b.count)
        mismatch("count " + std::to_string(a.count) + " vs " + std::to_string(b.count));
      if (a.root != b.root) mismatch("root " + std::to_string(a.root) + " vs " + std::to_string(b.root));
    }
    if (std::strcmp(a.op, "all_to_all") == 0)
      for (int p = 0; p < g_->n; ++p)
        for (int q = 0; q < g_->n; ++q)
          if ((*g_->slots[p].send_counts)[q] != (*g_->slots[q].recv_counts)[p])
            throw CollectiveError("threaded all_to_all: rank " + std::to_string(p) + " sends " +
                                  std::to_string((*g_->slots[p].send_counts)[q]) + " elements to rank " +
                                  std::to_string(q) + ", which expects " +
                                  std::to_string((*g_->slots[q].recv_counts)[p]));
  }

  template <class F>
  void execute(const Slot& slot, void* recv, F&& compute) {
    g_->slots[rank_] = slot;  // read by others only after the first rendezvous
    g_->rendezvous(rank_, slot.op);
    std::vector<char> out;
    std::exception_ptr err;
    try {
      check_agreement();
      compute(out);
    } catch (...) {
      err = std::current_exception();
    }
    g_->rendezvous(rank_, slot.op);  // everyone has finished reading the send buffers
    if (err) std::rethrow_exception(err);
    if (!out.empty()) std::memcpy(recv, out.data(), out.size());
  }

  std::shared_ptr<Group> g_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_threaded_group(int nranks) {
  if (nranks < 1) throw CollectiveError("make_threaded_group: nranks=" + std::to_string(nranks) + " must be >= 1");
  auto g = std::make_shared<Group>(nranks);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < nranks; ++r) comms.push_back(std::make_unique<ThreadedComm>(g, r));
  return comms;
}

void run_ranks(int nranks, const std::function<void(int)>& f) {
  std::vector<std::exception_ptr> errors(nranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r)
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace twin::rt
