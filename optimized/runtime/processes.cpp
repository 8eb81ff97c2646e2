// processes.cpp: the MPI launch (processes.h). Built against MPI when the build found it
// (TWIN_HAVE_MPI); otherwise one process, and a launch by mpirun is refused with the reason.
//
// Design: three duplicates of MPI_COMM_WORLD, so that traffic of one kind never matches a call of
// another: `control` (each phase's outcome, the exit status), `results` (what the host gathers for
// the report), `data` (the layers' collectives on the simulator, collectives_mpi.cpp). A data
// collective that timed out stays posted (MPI cannot cancel a collective), but the outcome of the
// phase still travels on `control`. Every call is nonblocking, then polled up to the deadline.
#include "optimized/runtime/processes.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "optimized/runtime/collectives_internal.h"

#if TWIN_HAVE_MPI
#include "optimized/runtime/processes_mpi.h"
#endif

namespace twin::rt {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

namespace {
// A collective of this process (or, after finish_processes, of any) timed out: MPI cannot cancel
// it, and MPI_Finalize would wait for it, so the process leaves without.
bool broken = false;
}  // namespace

#if TWIN_HAVE_MPI

bool processes_built() { return true; }

namespace detail {

World& world() {
  static World w;
  return w;
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

void mpi_check(int code, const std::string& what) {
  if (code != MPI_SUCCESS) throw CollectiveError("MPI " + what + ": " + mpi_error(code));
}

void wait(MPI_Request& req, const std::string& what, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (int polls = 0;; ++polls) {
    int done = 0;
    mpi_check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
    if (done) return;
    if (std::chrono::steady_clock::now() > deadline) {
      broken = true;
      throw CollectiveError("MPI: rank " + std::to_string(world().rank) + " waited " + std::to_string(seconds) +
                            " s in " + what + " for the other processes, which never all arrived");
    }
    if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

int as_int(std::size_t n, const std::string& what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw CollectiveError("MPI " + what + ": " + std::to_string(n) + " bytes exceed one message's limit");
  return static_cast<int>(n);
}

namespace {

std::string op_name(long long op) {
  static const char* const names[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                      "broadcast",  "gather",     "exit status"};
  if (op < 0 || op >= static_cast<long long>(std::size(names))) return "op " + std::to_string(op) + " (unknown)";
  return names[op];
}

long long& calls_on(MPI_Comm comm) {
  World& w = world();
  return w.calls[comm == w.control ? 0 : comm == w.results ? 1 : 2];
}

}  // namespace

std::vector<CheckIn> check_in(MPI_Comm comm, Op op, int root, std::size_t bytes, bool same_bytes,
                              const std::string& what, double seconds) {
  const World& w = world();
  // Past a timeout or a disagreement the processes are out of step: only the control channel, on
  // which they learn it, is still used.
  if (broken && comm != w.control)
    throw CollectiveError("MPI: " + what +
                          " not started: the processes fell out of step earlier (a collective timed "
                          "out or the processes disagreed)");
  const CheckIn mine{calls_on(comm)++, static_cast<long long>(op), root, static_cast<long long>(bytes), broken};
  std::vector<CheckIn> all(static_cast<std::size_t>(w.size));
  MPI_Request req;
  mpi_check(MPI_Iallgather(&mine, 5, MPI_LONG_LONG, all.data(), 5, MPI_LONG_LONG, comm, &req), what);
  wait(req, what, seconds);
  for (const CheckIn& c : all) broken = broken || c.broken != 0;
  for (int r = 1; r < w.size; ++r) {
    const CheckIn &a = all[0], &b = all[std::size_t(r)];
    if (a.call == b.call && a.op == b.op && a.root == b.root && (!same_bytes || a.bytes == b.bytes)) continue;
    auto call = [](const CheckIn& c) {
      return op_name(c.op) + " #" + std::to_string(c.call) + " (root " + std::to_string(c.root) + ", " +
             std::to_string(c.bytes) + " bytes)";
    };
    broken = true;
    throw CollectiveError("MPI: the processes disagree in " + what + ": rank 0 calls " + call(a) + ", rank " +
                          std::to_string(r) + " calls " + call(b));
  }
  return all;
}

// Every process's `mine` on `comm`, in rank order, each wait up to `seconds`.
std::vector<Bytes> allgather(MPI_Comm comm, const Bytes& mine, const std::string& what, double seconds) {
  const std::vector<CheckIn> in = check_in(comm, Op::Gather, 0, mine.size(), false, what, seconds);
  std::vector<int> counts, displs;
  std::size_t total = 0;
  for (const CheckIn& c : in) {
    counts.push_back(as_int(std::size_t(c.bytes), what));
    displs.push_back(as_int(total, what));
    total += std::size_t(c.bytes);
  }
  Bytes all(std::max<std::size_t>(total, 1));
  MPI_Request req;
  mpi_check(MPI_Iallgatherv(mine.data(), as_int(mine.size(), what), MPI_BYTE, all.data(), counts.data(), displs.data(),
                            MPI_BYTE, comm, &req),
            what);
  wait(req, what, seconds);
  std::vector<Bytes> out;
  for (std::size_t r = 0; r < in.size(); ++r)
    out.emplace_back(all.begin() + displs[r], all.begin() + displs[r] + counts[r]);
  return out;
}

}  // namespace detail

using detail::world;

void init_processes(int* argc, char*** argv) {
  detail::World& w = world();
  if (w.up || !launched_by_mpi()) return;
  int provided = 0;
  detail::mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_SERIALIZED)
    throw CollectiveError("MPI: this MPI library gives no thread support the twin can use (MPI_THREAD_SERIALIZED)");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  for (MPI_Comm* c : {&w.control, &w.results, &w.data}) {
    detail::mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, c), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(*c, MPI_ERRORS_RETURN);
  }
  w.up = true;
  std::atexit([] {
    // A collective that timed out is still posted: finalizing would wait for it.
    if (world().up && !broken) MPI_Finalize();
  });
}

int process_rank() { return world().rank; }
int process_count() { return world().size; }

std::vector<Bytes> process_allgather(const Bytes& mine) {
  if (!world().up) return {mine};
  return detail::allgather(world().results, mine, "the gather of the ranks' results", collective_timeout_seconds());
}

void process_broadcast(void* data, std::size_t bytes, int root) {
  const detail::World& w = world();
  if (!w.up) return;
  const std::string what = "the broadcast of rank " + std::to_string(root) + "'s results";
  detail::check_in(w.results, detail::Op::Broadcast, root, bytes, true, what);
  if (bytes == 0) return;
  MPI_Request req;
  detail::mpi_check(MPI_Ibcast(data, detail::as_int(bytes, what), MPI_BYTE, root, w.results, &req), what);
  detail::wait(req, what);
}

// A process meets the others here after its phase ended, which for a process left waiting in a
// collective by a failed one is that collective's deadline later: twice the deadline.
double control_seconds() { return 2 * collective_timeout_seconds() + 10; }

int finish_processes(int code) {
  const detail::World& w = world();
  if (!w.up) return code;
  int mine[2] = {code, broken ? 1 : 0}, all[2] = {code, 1};
  try {
    detail::check_in(w.control, detail::Op::Exit, 0, 0, true, "the exit status", control_seconds());
    MPI_Request req;
    detail::mpi_check(MPI_Iallreduce(mine, all, 2, MPI_INT, MPI_MAX, w.control, &req), "the exit status");
    detail::wait(req, "the exit status", control_seconds());
  } catch (const CollectiveError&) {
    all[0] = std::max(code, 1);
  }
  broken = broken || all[1] != 0;
  return all[0];
}

std::vector<Bytes> process_allgather_control(const Bytes& mine) {
  if (!world().up) return {mine};
  return detail::allgather(world().control, mine, "the exchange of each rank's outcome", control_seconds());
}

#else  // !TWIN_HAVE_MPI

bool processes_built() { return false; }

void init_processes(int*, char***) {
  if (launched_by_mpi())
    throw CollectiveError(
        "started by an MPI launcher, but this twin was built without MPI (install libopenmpi-dev and rebuild)");
}
int process_rank() { return 0; }
int process_count() { return 1; }
std::vector<Bytes> process_allgather(const Bytes& mine) { return {mine}; }
void process_broadcast(void*, std::size_t, int) {}
int finish_processes(int code) { return code; }
std::vector<Bytes> process_allgather_control(const Bytes& mine) { return {mine}; }
std::unique_ptr<Communicator> make_process_communicator(Backend) {
  throw CollectiveError("ranks as processes: built without MPI");
}

#endif

}  // namespace twin::rt
