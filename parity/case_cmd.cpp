#include "parity/case_cmd.h"

#include <fmt/format.h>

#include "parity/cli_common.h"
#include "parity/dense_run.h"

namespace twin::cli {

int run_case_command(const CaseOptions& opt, std::ostream& out, std::ostream& err) {
  if (opt.id.rfind("retro(", 0) == 0) {
    // The Retro cases' runner lives with their property tests (tests/optimized/retro/retro_case.h).
    err << "error: `twin case` reruns dense(...) ids; rerun a retro(...) id with TWIN_CASE='" << opt.id
        << "' RC_PARAMS=max_success=1 build/bin/test_optimized_retro_properties\n";
    return 2;
  }
  parity::DenseCase c;
  try {
    c = parity::parse_case_id(opt.id);
  } catch (const std::exception& e) {
    err << "error: " << one_line(e.what()) << "\n";
    return 2;
  }
  if (opt.graph && c.tp != 1 && opt.backend == "cuda") {
    // On the GPU the ranks' threaded collectives are host work a captured graph cannot hold (the
    // simulator captures them with each rank's kernels).
    err << "error: --graph on the GPU replays one rank's captured CUDA graph: it needs tp=1 there, the case has tp="
        << c.tp << "\n";
    return 2;
  }
  parity::RunOptions ro;
  ro.backend = opt.backend == "cuda" ? rt::Backend::Cuda : rt::Backend::Sim;
  ro.taps = !opt.graph;  // a captured graph runs without tap callbacks
  ro.use_graph = opt.graph;
  std::string why;
  if (!rt::available(ro.backend, &why)) {
    err << "error: backend " << opt.backend << " not available: " << why << "\n";
    return 2;
  }
  const parity::CaseResult r = parity::run_case(c, ro);
  out << r.report();
  if (r.pass() && !r.taps.rows.empty()) out << r.taps.format();
  out << fmt::format("{}: reference {:.3f} s, optimized ({}) {:.3f} s\n", r.pass() ? "PASS" : "FAIL",
                     r.seconds_reference, opt.backend, r.seconds_optimized);
  return r.pass() ? 0 : 1;
}

}  // namespace twin::cli
