// cudasim.cpp: the CUDA simulator's engine: blocks, fibers, barriers, warp operations, launches.
//
// Design:
// - One fiber per CUDA thread, switched with Boost.Context's fcontext (make_fcontext /
//   jump_fcontext: a register save/restore in user space, no system call). Stacks are mmap'ed once
//   per worker thread with a guard page, and reused by every block (CUDASIM_STACK_KB, default 128;
//   512 under ASan). Under ASan every switch is annotated (__sanitizer_start/finish_switch_fiber).
// - A block runs to completion on one worker thread. Its scheduler resumes runnable fibers in
//   rounds, in the order CUDASIM_ORDER = forward (thread 0 first) | reverse | random (a
//   permutation drawn per round from CUDASIM_SEED and the block index, so it is reproducible).
//   A fiber runs until it waits (barrier or warp operation) or returns.
// - __syncthreads: a fiber marks itself waiting at (file, line). When no fiber is runnable and
//   every live fiber waits at a barrier, the barrier is released; if some threads returned
//   instead, or the waiting threads are at different lines, the launch fails with a message.
// - Warp operations are rendezvous of the lanes named in the mask: the last lane to arrive
//   computes every participant's result. The caller missing from its mask, lanes that do not exist
//   (partial last warp), a shuffle reading a lane outside the mask, and (when nothing can run) a
//   mask naming lanes that returned or wait elsewhere, are reported with kernel, block, thread and
//   file:line. Reports are KernelError exceptions thrown by the launch.
// - Warp collectives (WMMA's load/mma/store, cudasim/wmma.h) are the same rendezvous over all 32
//   lanes of the warp, and stricter: every lane must arrive at the same call (operation and
//   file:line), since a warp-collective matrix operation executed by a diverged warp is undefined
//   in CUDA. A lane arriving while another waits at a different collective, or after a lane of its
//   warp returned, is reported at once; other never-completing waits by the stall diagnosis. The
//   last lane to arrive runs the operation over every lane's data (the lanes' fragments live on
//   their fiber stacks, all mapped while the block runs).
// - Blocks are taken from an atomic counter by the launching thread plus up to CUDASIM_WORKERS-1
//   pool threads (default: hardware threads). The first error stops further blocks.
// - A block that fails is abandoned: its suspended fibers are never resumed (their stacks are
//   reused; objects they hold are leaked), which is why kernels should not own heap memory.
#include "cuda_compat.h"
#include "optimized/runtime/sim_stream.h"
#include "optimized/runtime/cost_model.h"

#include <boost/context/detail/fcontext.hpp>
#include <link.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <tuple>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "optimized/runtime/cudasim_options.h"

#if defined(TWIN_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace fctx = boost::context::detail;

namespace cudasim {

// ---- options -------------------------------------------------------------------------------------
namespace {

Options options_from_env() {
  Options o;
  if (const char* s = std::getenv("CUDASIM_ORDER"); s && *s) {
    std::string v = s;
    if (v == "forward")
      o.order = Order::Forward;
    else if (v == "reverse")
      o.order = Order::Reverse;
    else if (v == "random")
      o.order = Order::Random;
    else
      throw std::invalid_argument("CUDASIM_ORDER='" + v + "': expected forward, reverse or random");
  }
  if (const char* s = std::getenv("CUDASIM_SEED"); s && *s) o.seed = std::strtoull(s, nullptr, 10);
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  o.workers = static_cast<int>(hw);
  if (const char* s = std::getenv("CUDASIM_WORKERS"); s && *s) {
    int w = std::atoi(s);
    if (w < 1) throw std::invalid_argument(std::string("CUDASIM_WORKERS='") + s + "': expected a positive integer");
    o.workers = w;
  }
  return o;
}

std::mutex g_options_mutex;
Options& options_ref() {
  static Options o = options_from_env();
  return o;
}

}  // namespace

Options options() {
  std::lock_guard<std::mutex> lock(g_options_mutex);
  return options_ref();
}
void set_options(const Options& o) {
  if (o.workers < 1) throw std::invalid_argument("cudasim::set_options: workers must be >= 1");
  std::lock_guard<std::mutex> lock(g_options_mutex);
  options_ref() = o;
}
const char* order_name(Order o) {
  switch (o) {
    case Order::Forward:
      return "forward";
    case Order::Reverse:
      return "reverse";
    case Order::Random:
      return "random";
  }
  return "?";
}

namespace detail {

namespace {

enum class State : std::uint8_t { Runnable, AtBarrier, AtWarp, Exited };

struct Fiber {
  ThreadCtx t;  // what threadIdx reads
  fctx::fcontext_t fc = nullptr;
  State state = State::Runnable;
  unsigned linear = 0, warp = 0, lane = 0;
  const char* file = nullptr;  // where it waits
  int line = 0;
  WarpOp op = WarpOp::SyncWarp;
  unsigned mask = 0;
  std::uint64_t value = 0, result = 0;
  int arg = 0, width = 32;
  const char* coll_name = nullptr;  // WarpOp::Collective: its name, lane data and the operation
  void* coll_data = nullptr;
  CollectiveFn coll_fn = nullptr;
  int pred = 0;  // __syncthreads_count/and/or predicate
  char* stack_lo = nullptr;
  std::size_t stack_size = 0;
  void* asan_fake = nullptr;
};

struct Launch {
  LaunchSpec spec;
  Thunk thunk;
  std::shared_ptr<const void> ctx;
  std::string name;
  Options opts;
  std::uint64_t nblocks = 0;
  std::atomic<std::uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;
  int helpers = 0;  // pool threads working on it (guarded by the pool mutex)
  int max_helpers = 0;
  int joined = 0;
};

struct Stack {
  char* lo = nullptr;  // lowest usable address (above the guard page)
  std::size_t size = 0;
};

std::size_t stack_bytes() {
#if defined(TWIN_ASAN)
  std::size_t kb = 512;
#else
  std::size_t kb = 128;
#endif
  if (const char* s = std::getenv("CUDASIM_STACK_KB"); s && *s)
    kb = std::max<std::size_t>(16, std::strtoull(s, nullptr, 10));
  return kb * 1024;
}

struct Worker {
  std::vector<Stack> stacks;
  std::vector<Fiber> fibers;
  std::vector<unsigned> order;
  std::vector<unsigned> warp_waiting;
  std::mt19937_64 rng;  // per warp: bit l set while lane l waits at a warp operation
  unsigned char* smem = nullptr;
  std::size_t smem_cap = 0;
  char* static_smem = nullptr;  // this worker thread's "cudasim_shared" section
  std::size_t static_smem_size = 0;
  fctx::fcontext_t sched = nullptr;
  Fiber* current = nullptr;
  Launch* launch = nullptr;
  bool in_block = false;
  bool stacks_dirty = false;
  unsigned n = 0, live = 0, runnable = 0, at_barrier = 0, exited = 0;
  int barrier_count = 0;  // predicates of the last released barrier
  std::exception_ptr fiber_error;
  const void* asan_bottom = nullptr;
  std::size_t asan_size = 0;

  ~Worker() {
    for (auto& s : stacks) {
#if defined(TWIN_ASAN)
      // Frames left on a fiber stack keep their redzones in ASan's shadow after munmap; memory mapped
      // later at the same address (a safetensors file, say) would then read as a stack overflow.
      __asan_unpoison_memory_region(s.lo, s.size);
#endif
      munmap(s.lo - page(), s.size + page());
    }
    std::free(smem);
  }
  static std::size_t page() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

  void ensure_threads(unsigned count) {
    if (fibers.size() < count) fibers.resize(count);
    if (order.size() < count) order.resize(count);
    std::size_t sz = stack_bytes();
    while (stacks.size() < count) {
      std::size_t total = sz + page();
      void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw KernelError("cudasim: cannot map a fiber stack");
      mprotect(p, page(), PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
      stacks.push_back(Stack{static_cast<char*>(p) + page(), sz});
    }
  }
  void ensure_smem(std::size_t bytes) {
    if (smem_cap < bytes || !smem) {
      std::free(smem);
      std::size_t cap = std::max<std::size_t>(bytes, 1024);
      smem = static_cast<unsigned char*>(std::aligned_alloc(128, (cap + 127) / 128 * 128));
      if (!smem) throw KernelError("cudasim: cannot allocate dynamic shared memory");
      smem_cap = cap;
    }
  }
};

thread_local Worker* tl_worker = nullptr;

// ---- static __shared__ memory: the "cudasim_shared" TLS section ----
// The linker defines __start_/__stop_ for a section named like a C identifier; the marker makes
// sure the section exists even in programs without a __shared__ variable. A thread's copy of the
// section is found the way general-dynamic TLS code finds a variable: __tls_get_addr with the
// executable's module id (1) and the section's offset in the executable's TLS segment.
extern "C" char __start_cudasim_shared[], __stop_cudasim_shared[];
thread_local __attribute__((section("cudasim_shared"), used)) char g_shared_marker[16];
struct TlsIndex {
  unsigned long module, offset;
};
extern "C" void* __tls_get_addr(TlsIndex*);

// This thread's copy of the section and its size; {nullptr, 0} if it cannot be located safely.
std::pair<char*, std::size_t> static_shared_section() {
  static const std::uintptr_t tls_start = [] {
    std::uintptr_t start = 0;
    dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void* out) {
          for (int i = 0; i < info->dlpi_phnum; ++i)
            if (info->dlpi_phdr[i].p_type == PT_TLS)
              *static_cast<std::uintptr_t*>(out) = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
          return 1;  // the first object is the executable
        },
        &start);
    return start;
  }();
  const std::size_t size = static_cast<std::size_t>(__stop_cudasim_shared - __start_cudasim_shared);
  const auto sec = reinterpret_cast<std::uintptr_t>(__start_cudasim_shared);
  if (tls_start == 0 || sec < tls_start) return {nullptr, 0};
  TlsIndex ti{1, sec - tls_start};
  char* start = static_cast<char*>(__tls_get_addr(&ti));
  // Sanity check: this thread's marker must lie inside the range found.
  char* marker = g_shared_marker;
  if (marker < start || marker + sizeof(g_shared_marker) > start + size) {
    static std::once_flag warned;
    std::call_once(warned, [] {
      std::fprintf(stderr,
                   "cudasim: cannot locate static __shared__ memory (kernels in a shared library?); "
                   "it will not be poisoned between blocks\n");
    });
    return {nullptr, 0};
  }
  return {start, size};
}

#if !defined(TWIN_ASAN)
// A fiber that overflows its stack hits the guard page below it: say so instead of a bare SIGSEGV
// (then crash as before; ASan builds have their own report). Other faults go to the previous handler.
struct sigaction g_prev_segv;
void segv_handler(int sig, siginfo_t* info, void* uctx) {
  const Worker* w = tl_worker;
  const char* addr = static_cast<const char*>(info->si_addr);
  if (w && w->in_block) {
    for (const auto& st : w->stacks) {
      if (addr >= st.lo - Worker::page() && addr < st.lo) {
        static const char msg[] =
            "cudasim: a kernel thread overflowed its fiber stack (guard page hit); "
            "raise CUDASIM_STACK_KB (default 128) or shrink the kernel's local arrays\n";
        ssize_t ignored = write(2, msg, sizeof(msg) - 1);
        (void)ignored;
        signal(SIGSEGV, SIG_DFL);
        raise(SIGSEGV);
        return;
      }
    }
  }
  if (g_prev_segv.sa_flags & SA_SIGINFO) {
    if (g_prev_segv.sa_sigaction) return g_prev_segv.sa_sigaction(sig, info, uctx);
  } else if (g_prev_segv.sa_handler != SIG_DFL && g_prev_segv.sa_handler != SIG_IGN && g_prev_segv.sa_handler) {
    return g_prev_segv.sa_handler(sig);
  }
  signal(SIGSEGV, SIG_DFL);
  raise(SIGSEGV);
}
// The handler needs its own stack (the faulting one is exhausted): one per thread that runs blocks.
void install_overflow_report() {
  thread_local std::unique_ptr<char[]> alt;
  if (!alt) {
    alt.reset(new char[64 * 1024]);
    stack_t ss{};
    ss.ss_sp = alt.get();
    ss.ss_size = 64 * 1024;
    sigaltstack(&ss, nullptr);
  }
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = &segv_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
  });
}
#endif

Worker& this_worker() {
  thread_local std::unique_ptr<Worker> w;
  if (!w) {
    w = std::make_unique<Worker>();
    tl_worker = w.get();
    std::tie(w->static_smem, w->static_smem_size) = static_shared_section();
#if !defined(TWIN_ASAN)
    install_overflow_report();
#endif
  }
  return *w;
}

std::string dim_str(const uint3& d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}
std::string dim_str(const dim3& d) { return dim_str(uint3{d.x, d.y, d.z}); }

std::string hex(unsigned m) {
  std::ostringstream os;
  os << "0x" << std::hex << m;
  return os.str();
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::Shfl:
      return "__shfl_sync";
    case WarpOp::ShflUp:
      return "__shfl_up_sync";
    case WarpOp::ShflDown:
      return "__shfl_down_sync";
    case WarpOp::ShflXor:
      return "__shfl_xor_sync";
    case WarpOp::Ballot:
      return "__ballot_sync";
    case WarpOp::Any:
      return "__any_sync";
    case WarpOp::All:
      return "__all_sync";
    case WarpOp::SyncWarp:
      return "__syncwarp";
    case WarpOp::Collective:
      return "warp collective";
  }
  return "?";
}
// The operation a waiting lane is at (a collective by its own name).
const char* op_label(const Fiber& f) { return f.op == WarpOp::Collective && f.coll_name ? f.coll_name : op_name(f.op); }
// Whether lanes a and b wait at the same warp operation: same op and mask, and for a collective
// also the same name and call site.
bool same_warp_op(const Fiber& a, const Fiber& b) {
  if (a.op != b.op || a.mask != b.mask) return false;
  if (a.op != WarpOp::Collective) return true;
  return a.coll_fn == b.coll_fn && a.line == b.line && std::strcmp(a.file, b.file) == 0;
}

std::string where(const char* file, int line) { return std::string(file ? file : "?") + ":" + std::to_string(line); }

// "cudasim: kernel 'k' block (x,y,z) thread (x,y,z): "
std::string prefix(const Worker& w, const Fiber* f) {
  std::string s = "cudasim: kernel '" + w.launch->name + "' block " + dim_str(tl_block_idx);
  if (f) s += " thread " + dim_str(f->t.tid);
  return s + ": ";
}

// ---- fiber switching ----
void fiber_entry(fctx::transfer_t t) {
  Worker* w = static_cast<Worker*>(t.data);
  w->sched = t.fctx;
#if defined(TWIN_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &w->asan_bottom, &w->asan_size);
#endif
  Fiber* f = w->current;
  try {
    w->launch->thunk(w->launch->ctx.get());
  } catch (const KernelError&) {
    if (!w->fiber_error) w->fiber_error = std::current_exception();
  } catch (const std::exception& e) {
    if (!w->fiber_error)
      w->fiber_error = std::make_exception_ptr(KernelError(prefix(*w, f) + "exception in kernel: " + e.what()));
  } catch (...) {
    if (!w->fiber_error)
      w->fiber_error = std::make_exception_ptr(KernelError(prefix(*w, f) + "unknown exception in kernel"));
  }
  f->state = State::Exited;
  --w->live;
  --w->runnable;
  ++w->exited;
#if defined(TWIN_ASAN)
  __sanitizer_start_switch_fiber(nullptr, w->asan_bottom, w->asan_size);
#endif
  fctx::jump_fcontext(w->sched, nullptr);  // never resumed
  std::abort();
}

void resume(Worker& w, Fiber& f) {
  w.current = &f;
  tl_thread = &f.t;
#if defined(TWIN_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack_lo, f.stack_size);
#endif
  fctx::transfer_t t = fctx::jump_fcontext(f.fc, &w);
#if defined(TWIN_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  f.fc = t.fctx;
  tl_thread = nullptr;
}

// Called on the fiber: gives control back to the block scheduler until resumed.
void suspend(Worker& w, Fiber& f) {
  (void)f;  // only the ASan annotations need it
#if defined(TWIN_ASAN)
  __sanitizer_start_switch_fiber(&f.asan_fake, w.asan_bottom, w.asan_size);
#endif
  fctx::transfer_t t = fctx::jump_fcontext(w.sched, nullptr);
#if defined(TWIN_ASAN)
  __sanitizer_finish_switch_fiber(f.asan_fake, &w.asan_bottom, &w.asan_size);
#endif
  w.sched = t.fctx;
}

Worker& kernel_worker(const char* what) {
  Worker* w = tl_worker;
  if (!w || !w->in_block || !w->current) not_in_kernel(what);
  return *w;
}

// ---- diagnosis when no fiber can run ----
std::string describe_wait(const Fiber& g) {
  switch (g.state) {
    case State::Exited:
      return "has returned";
    case State::AtBarrier:
      return "waits at __syncthreads() at " + where(g.file, g.line);
    case State::AtWarp:
      return std::string("waits at ") + op_label(g) + " with mask " + hex(g.mask) + " at " + where(g.file, g.line);
    case State::Runnable:
      return "is runnable";
  }
  return "?";
}

std::string diagnose_stall(Worker& w) {
  const unsigned n = w.n;
  // A warp operation whose mask names a lane that is not at the same operation.
  for (unsigned i = 0; i < n; ++i) {
    const Fiber& f = w.fibers[i];
    if (f.state != State::AtWarp) continue;
    unsigned base = f.warp * 32;
    for (unsigned l = 0; l < 32; ++l) {
      if (!((f.mask >> l) & 1u)) continue;
      const Fiber& g = w.fibers[base + l];
      if (g.state == State::AtWarp && same_warp_op(g, f)) continue;
      return prefix(w, &f) + op_label(f) + " at " + where(f.file, f.line) + " (warp " + std::to_string(f.warp) +
             ", lane " + std::to_string(f.lane) + ") never completes: its mask " + hex(f.mask) + " names lane " +
             std::to_string(l) + " (thread " + dim_str(g.t.tid) + "), which " + describe_wait(g);
    }
  }
  // Only barrier waiters (and returned threads) remain.
  const Fiber* first = nullptr;
  for (unsigned i = 0; i < n; ++i)
    if (w.fibers[i].state == State::AtBarrier) {
      first = &w.fibers[i];
      break;
    }
  if (!first) return prefix(w, nullptr) + "no thread can run (internal error)";
  for (unsigned i = 0; i < n; ++i) {
    const Fiber& g = w.fibers[i];
    if (g.state == State::AtBarrier && (g.line != first->line || std::strcmp(g.file, first->file) != 0)) {
      unsigned a = 0, b = 0;
      for (unsigned j = 0; j < n; ++j) {
        const Fiber& h = w.fibers[j];
        if (h.state != State::AtBarrier) continue;
        if (h.line == first->line && std::strcmp(h.file, first->file) == 0)
          ++a;
        else if (h.line == g.line && std::strcmp(h.file, g.file) == 0)
          ++b;
      }
      return prefix(w, &g) + "threads wait at different __syncthreads(): thread " + dim_str(g.t.tid) + " at " +
             where(g.file, g.line) + " (" + std::to_string(b) + " threads), thread " + dim_str(first->t.tid) + " at " +
             where(first->file, first->line) + " (" + std::to_string(a) + " threads)";
    }
  }
  for (unsigned i = 0; i < n; ++i) {
    const Fiber& g = w.fibers[i];
    if (g.state == State::Exited)
      return prefix(w, &g) + "returned before reaching the __syncthreads() at " + where(first->file, first->line) +
             " where " + std::to_string(w.at_barrier) +
             " threads of the block wait (threads returned: " + std::to_string(w.exited) + ")";
  }
  return prefix(w, nullptr) + "no thread can run (internal error)";
}

void run_block(Worker& w, Launch& L, std::uint64_t block_linear) {
  const LaunchSpec& sp = L.spec;
  tl_block_idx = uint3{static_cast<unsigned>(block_linear % sp.grid.x),
                       static_cast<unsigned>((block_linear / sp.grid.x) % sp.grid.y),
                       static_cast<unsigned>(block_linear / (static_cast<std::uint64_t>(sp.grid.x) * sp.grid.y))};
  tl_block_dim = sp.block;
  tl_grid_dim = sp.grid;
  const unsigned n = sp.block.x * sp.block.y * sp.block.z;
  w.ensure_threads(n);
  w.ensure_smem(sp.smem);
  std::memset(w.smem, 0xFF, std::max<std::size_t>(sp.smem, 1));  // poison: NaN for floats, -1 for ints
  if (w.static_smem) std::memset(w.static_smem, 0xFF, w.static_smem_size);
  tl_dyn_smem = w.smem;
#if defined(TWIN_ASAN)
  if (w.stacks_dirty) {  // frames of an abandoned block left redzones behind
    for (auto& s : w.stacks) __asan_unpoison_memory_region(s.lo, s.size);
    w.stacks_dirty = false;
  }
#endif
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    f.t.tid = uint3{i % sp.block.x, (i / sp.block.x) % sp.block.y, i / (sp.block.x * sp.block.y)};
    f.linear = i;
    f.warp = i / 32;
    f.lane = i % 32;
    f.state = State::Runnable;
    f.stack_lo = w.stacks[i].lo;
    f.stack_size = w.stacks[i].size;
    f.fc = fctx::make_fcontext(f.stack_lo + f.stack_size, f.stack_size, &fiber_entry);
    w.order[i] = L.opts.order == Order::Reverse ? n - 1 - i : i;
  }
  w.warp_waiting.assign((n + 31) / 32, 0u);
  w.n = n;
  w.live = w.runnable = n;
  w.at_barrier = w.exited = 0;
  w.fiber_error = nullptr;
  w.launch = &L;
  w.in_block = true;
  std::mt19937_64& rng = w.rng;  // a member: constructing one per block costs a full state init
  if (L.opts.order == Order::Random) rng.seed(L.opts.seed * 0x9E3779B97F4A7C15ull + block_linear);

  std::string failure;
  while (w.live > 0) {
    if (L.opts.order == Order::Random) std::shuffle(w.order.begin(), w.order.begin() + n, rng);
    for (unsigned k = 0; k < n; ++k) {
      Fiber& f = w.fibers[w.order[k]];
      if (f.state != State::Runnable) continue;
      resume(w, f);
      if (w.fiber_error) break;
    }
    if (w.fiber_error || w.live == 0) break;
    if (w.runnable > 0) continue;
    // Nothing can run: release the barrier, or report why the block is stuck.
    bool same_barrier = w.at_barrier == w.live && w.exited == 0;
    if (same_barrier) {
      const Fiber* first = nullptr;
      for (unsigned i = 0; i < n && same_barrier; ++i) {
        const Fiber& g = w.fibers[i];
        if (!first)
          first = &g;
        else if (g.line != first->line || std::strcmp(g.file, first->file) != 0)
          same_barrier = false;
      }
    }
    if (!same_barrier) {
      failure = diagnose_stall(w);
      break;
    }
    w.barrier_count = 0;
    for (unsigned i = 0; i < n; ++i) {
      w.fibers[i].state = State::Runnable;
      w.barrier_count += w.fibers[i].pred;
    }
    w.runnable = n;
    w.at_barrier = 0;
  }
  w.in_block = false;
  w.current = nullptr;
  tl_dyn_smem = nullptr;
  if (w.fiber_error || !failure.empty()) {
    if (w.live > 0) w.stacks_dirty = true;
    if (w.fiber_error) std::rethrow_exception(w.fiber_error);
    throw KernelError(failure);
  }
}

// ---- worker pool ----
void work_on(Launch& L) {
  Worker& w = this_worker();
  while (!L.failed.load(std::memory_order_relaxed)) {
    std::uint64_t b = L.next.fetch_add(1);
    if (b >= L.nblocks) break;
    try {
      run_block(w, L, b);
    } catch (...) {
      std::lock_guard<std::mutex> lock(L.error_mutex);
      if (!L.error) L.error = std::current_exception();
      L.failed = true;
    }
  }
}

class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool();  // never destroyed: threads may still wait at exit
    return *p;
  }
  // Runs every block of L on the calling thread plus up to L.max_helpers pool threads.
  void run(Launch& L) {
    if (L.max_helpers > 0) {
      std::unique_lock<std::mutex> lock(m_);
      while (static_cast<int>(threads_.size()) < L.max_helpers) threads_.emplace_back([this] { loop(); });
      jobs_.push_back(&L);
      cv_.notify_all();
    }
    work_on(L);
    if (L.max_helpers > 0) {
      std::unique_lock<std::mutex> lock(m_);
      remove(&L);
      done_cv_.wait(lock, [&] { return L.helpers == 0; });
    }
  }

 private:
  void remove(Launch* L) {
    auto it = std::find(jobs_.begin(), jobs_.end(), L);
    if (it != jobs_.end()) jobs_.erase(it);
  }
  // A job that still has blocks and room for one more helper (dropping exhausted ones).
  Launch* pick() {
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      Launch* L = *it;
      if (L->next.load() >= L->nblocks || L->failed.load()) {
        it = jobs_.erase(it);
        continue;
      }
      if (L->joined < L->max_helpers) return L;
      ++it;
    }
    return nullptr;
  }
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      Launch* L = nullptr;
      cv_.wait(lock, [&] { return (L = pick()) != nullptr; });
      ++L->helpers;
      ++L->joined;
      lock.unlock();
      work_on(*L);
      lock.lock();
      if (--L->helpers == 0) done_cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::deque<Launch*> jobs_;
  std::vector<std::thread> threads_;
};

void check_config(const Launch& L) {
  const LaunchSpec& s = L.spec;
  auto bad = [&](const std::string& why) {
    throw KernelError("cudasim: launch_kernel(" + L.name + ") at " + where(s.file, s.line) +
                      ": invalid configuration: " + why);
  };
  if (s.grid.x == 0 || s.grid.y == 0 || s.grid.z == 0) bad("grid " + dim_str(s.grid) + " has a zero dimension");
  if (s.block.x == 0 || s.block.y == 0 || s.block.z == 0) bad("block " + dim_str(s.block) + " has a zero dimension");
  if (s.grid.y > 65535 || s.grid.z > 65535) bad("grid " + dim_str(s.grid) + ": y and z must be <= 65535");
  if (s.grid.x > 2147483647u) bad("grid.x must be < 2^31");
  if (s.block.x > 1024 || s.block.y > 1024 || s.block.z > 64)
    bad("block " + dim_str(s.block) + " exceeds (1024,1024,64)");
  if (static_cast<std::uint64_t>(s.block.x) * s.block.y * s.block.z > 1024)
    bad("block " + dim_str(s.block) + " has more than 1024 threads");
  if (s.smem > 232448) bad(std::to_string(s.smem) + " bytes of dynamic shared memory exceed sm_90's 227 KiB");
}

void run_grid(const LaunchSpec& spec, Thunk thunk, std::shared_ptr<const void> ctx) {
  // Dynamic parallelism (a launch from kernel code) is not simulated: named with the launching
  // kernel's block and thread, and the launch's own file:line.
  if (tl_worker && tl_worker->in_block)
    throw KernelError(prefix(*tl_worker, tl_worker->current) + "launch_kernel(" +
                      kernel_name_from_args(spec.args_text) + ") at " + where(spec.file, spec.line) +
                      ": launching from device code (dynamic parallelism) is not supported");
  Launch L;
  L.spec = spec;
  L.thunk = thunk;
  L.ctx = std::move(ctx);
  L.name = kernel_name_from_args(spec.args_text);
  L.opts = options();
  check_config(L);
  L.nblocks = static_cast<std::uint64_t>(spec.grid.x) * spec.grid.y * spec.grid.z;
  L.max_helpers =
      static_cast<int>(std::min<std::uint64_t>(static_cast<std::uint64_t>(L.opts.workers - 1), L.nblocks - 1));
  Pool::get().run(L);
  if (L.error) std::rethrow_exception(L.error);
}

}  // namespace

[[noreturn]] void not_in_kernel(const char* what) {
  throw KernelError(std::string("cudasim: ") + what + " used outside a kernel launched with launch_kernel");
}

void launch(cudaStream_t stream, const LaunchSpec& spec, Thunk thunk, std::shared_ptr<const void> ctx) {
  twin::rt::note_kernel_launch(kernel_name_from_args(spec.args_text));
  enqueue(stream, [spec, thunk, ctx = std::move(ctx)] { run_grid(spec, thunk, ctx); });
}

void enqueue(cudaStream_t stream, std::function<void()> work) {
  SimStream* s = sim_stream(stream);
  if (s && s->capturing) {
    s->recorded.push_back(std::move(work));
    return;
  }
  work();
}

int syncthreads(const char* file, int line, int pred) {
  Worker& w = kernel_worker("__syncthreads()");
  Fiber& f = *w.current;
  f.pred = pred;
  f.state = State::AtBarrier;
  f.file = file;
  f.line = line;
  ++w.at_barrier;
  --w.runnable;
  suspend(w, f);
  return w.barrier_count;  // stable until every thread reaches the next barrier
}

unsigned activemask() {
  Worker& w = kernel_worker("__activemask()");
  Fiber& f = *w.current;
  unsigned m = 0, base = f.warp * 32;
  for (unsigned l = 0; l < 32 && base + l < w.n; ++l)
    if (w.fibers[base + l].state != State::Exited) m |= 1u << l;
  return m;
}

namespace {
bool is_shuffle(WarpOp op) {
  return op == WarpOp::Shfl || op == WarpOp::ShflUp || op == WarpOp::ShflDown || op == WarpOp::ShflXor;
}
// The lane a shuffle reads (CUDA semantics with width; out-of-segment reads return the own value).
unsigned shuffle_source(WarpOp op, unsigned lane, int arg, int width) {
  unsigned w = static_cast<unsigned>(width);
  unsigned seg = lane & ~(w - 1);
  switch (op) {
    case WarpOp::Shfl:
      return seg + (static_cast<unsigned>(arg) & (w - 1));
    case WarpOp::ShflUp:
      return (lane - seg) < static_cast<unsigned>(arg) ? lane : lane - arg;
    case WarpOp::ShflDown:
      return (lane - seg) + static_cast<unsigned>(arg) >= w ? lane : lane + arg;
    case WarpOp::ShflXor: {
      unsigned src = lane ^ static_cast<unsigned>(arg);
      return src >= seg + w ? lane : src;  // later segments cannot be read
    }
    default:
      return lane;
  }
}
}  // namespace

std::uint64_t warp_op(WarpOp op, const char* file, int line, unsigned mask, std::uint64_t value, int arg, int width) {
  Worker& w = kernel_worker(op_name(op));
  Fiber& f = *w.current;
  const unsigned base = f.warp * 32;
  const unsigned warp_size = std::min(32u, w.n - base);
  const unsigned exist = warp_size == 32 ? 0xffffffffu : ((1u << warp_size) - 1);
  auto fail = [&](const std::string& what) -> void {
    throw KernelError(prefix(w, &f) + op_name(op) + " at " + where(file, line) + " (warp " + std::to_string(f.warp) +
                      ", lane " + std::to_string(f.lane) + "): " + what);
  };
  if (!((mask >> f.lane) & 1u)) fail("the calling lane " + std::to_string(f.lane) + " is not in its mask " + hex(mask));
  if (mask & ~exist)
    fail("mask " + hex(mask) + " names lanes that do not exist (" + hex(mask & ~exist) + "): warp " +
         std::to_string(f.warp) + " has " + std::to_string(warp_size) + " threads");
  if (is_shuffle(op) && (width < 1 || width > 32 || (width & (width - 1)) != 0))
    fail("width " + std::to_string(width) + " is not a power of two in [1, 32]");
  f.op = op;
  f.mask = mask;
  f.value = value;
  f.arg = arg;
  f.width = width;
  f.file = file;
  f.line = line;
  // Complete when every lane of the mask waits at the same operation with the same mask (the
  // bitmask makes the common "not everyone is here yet" answer O(1)).
  unsigned& waiting = w.warp_waiting[f.warp];
  bool complete = ((waiting | (1u << f.lane)) & mask) == mask;
  for (unsigned l = 0; complete && l < 32; ++l) {
    if (!((mask >> l) & 1u) || l == f.lane) continue;
    const Fiber& g = w.fibers[base + l];
    if (g.op != op || g.mask != mask) complete = false;
  }
  if (!complete) {
    f.state = State::AtWarp;
    --w.runnable;
    waiting |= 1u << f.lane;
    suspend(w, f);
    return f.result;
  }
  std::uint64_t ballot = 0;
  if (op == WarpOp::Ballot || op == WarpOp::Any || op == WarpOp::All)
    for (unsigned l = 0; l < 32; ++l)
      if (((mask >> l) & 1u) && w.fibers[base + l].value) ballot |= 1ull << l;
  for (unsigned l = 0; l < 32; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Fiber& g = w.fibers[base + l];
    std::uint64_t r = 0;
    if (is_shuffle(op)) {
      unsigned src = shuffle_source(op, l, g.arg, g.width);
      if (src != l && (src >= warp_size || !((mask >> src) & 1u))) {
        std::string what = src >= warp_size ? "does not exist (warp " + std::to_string(f.warp) + " has " +
                                                  std::to_string(warp_size) + " threads)"
                                            : "is not in the mask " + hex(mask);
        throw KernelError(prefix(w, &g) + op_name(op) + " at " + where(g.file, g.line) + " (warp " +
                          std::to_string(g.warp) + ", lane " + std::to_string(l) + ") reads lane " +
                          std::to_string(src) + ", which " + what);
      }
      r = w.fibers[base + src].value;
    } else if (op == WarpOp::Ballot) {
      r = ballot;
    } else if (op == WarpOp::Any) {
      r = ballot != 0;
    } else if (op == WarpOp::All) {
      r = ballot == mask;
    }
    g.result = r;
    if (l != f.lane) {
      g.state = State::Runnable;
      ++w.runnable;
    }
  }
  waiting &= ~mask;
  return f.result;
}

[[noreturn]] void warp_misuse(const char* name, const char* file, int line, const std::string& what) {
  Worker& w = kernel_worker(name);
  const Fiber& f = *w.current;
  throw KernelError(prefix(w, &f) + name + " at " + where(file, line) + " (warp " + std::to_string(f.warp) + ", lane " +
                    std::to_string(f.lane) + "): " + what);
}

void warp_collective(const char* name, const char* file, int line, void* data, CollectiveFn complete) {
  Worker& w = kernel_worker(name);
  Fiber& f = *w.current;
  const unsigned base = f.warp * 32;
  const unsigned warp_size = std::min(32u, w.n - base);
  if (warp_size != 32)
    warp_misuse(
        name, file, line,
        "needs a full warp of 32 threads; warp " + std::to_string(f.warp) + " has " + std::to_string(warp_size));
  f.op = WarpOp::Collective;
  f.mask = 0xffffffffu;
  f.coll_name = name;
  f.coll_data = data;
  f.coll_fn = complete;
  f.file = file;
  f.line = line;
  // A lane that returned, or that waits at another collective, can never arrive here: the warp
  // diverged (each lane waits for the others forever on a GPU too).
  for (unsigned l = 0; l < 32; ++l) {
    const Fiber& g = w.fibers[base + l];
    if (l == f.lane) continue;
    if (g.state == State::Exited)
      warp_misuse(name, file, line,
                  "the warp diverged: lane " + std::to_string(l) + " (thread " + dim_str(g.t.tid) +
                      ") has returned, but all 32 lanes must execute this call");
    if (g.state == State::AtWarp && g.op == WarpOp::Collective && !same_warp_op(g, f))
      warp_misuse(name, file, line,
                  "the warp diverged: lane " + std::to_string(l) + " (thread " + dim_str(g.t.tid) + ") waits at " +
                      op_label(g) + " at " + where(g.file, g.line) + "; all 32 lanes must execute the same call");
  }
  unsigned& waiting = w.warp_waiting[f.warp];
  bool complete_now = (waiting | (1u << f.lane)) == 0xffffffffu;
  for (unsigned l = 0; complete_now && l < 32; ++l)
    if (l != f.lane && !same_warp_op(w.fibers[base + l], f)) complete_now = false;
  if (!complete_now) {
    f.state = State::AtWarp;
    --w.runnable;
    waiting |= 1u << f.lane;
    suspend(w, f);
    return;
  }
  void* lane_data[32];
  for (unsigned l = 0; l < 32; ++l) lane_data[l] = w.fibers[base + l].coll_data;
  try {
    complete(lane_data);
  } catch (const KernelError&) {
    throw;
  } catch (const std::exception& e) {
    warp_misuse(name, file, line, e.what());
  }
  for (unsigned l = 0; l < 32; ++l) {
    Fiber& g = w.fibers[base + l];
    if (l != f.lane) {
      g.state = State::Runnable;
      ++w.runnable;
    }
  }
  waiting = 0;
}

}  // namespace detail
}  // namespace cudasim
