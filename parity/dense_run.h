// Running a dense-layer case through both twins, and the optimized twin's `dense_layer` fixture
// handler. Shared by the property tests, `twin check` and `twin case <id>`.
//
// The bound (parity/bounds.h reference_error_bound): the reference runs twice, mirroring Megatron
// (ComputeMode::FP32, rounding where Megatron stores) and exactly (fp64, no rounding); the
// optimized twin may differ from the reference by the dtype default plus twice the reference's
// own max error against the exact run.
#pragma once

#include <string>
#include <vector>

#include "core/record.h"
#include "optimized/layer/options.h"
#include "optimized/runtime/device.h"
#include "parity/compare.h"
#include "parity/dense_case.h"
#include "parity/tap_diff.h"
#include "reference/precision.h"

namespace twin::parity {

struct RunOptions {
  rt::Backend backend = rt::Backend::Sim;
  bool taps = false;       // record taps (at tp > 1 gathered across the ranks); not with use_graph
  bool use_graph = false;  // optimized: capture a CUDA graph and replay it
};

// The reference layer (local GPT spec) on the case's inputs. mode FP32 mirrors Megatron; Exact is
// fp64 without rounding (the output is then F64).
// With `record`: taps and rounding counts recorded there.
Tensor reference_forward(const DenseCase& c, const DenseInputs& in, bool exact, Record* record = nullptr);
// The same in any of the reference's modes (reference/precision.h; Fast: fp32 GEMMs through BLAS).
Tensor reference_forward(const DenseCase& c, const DenseInputs& in, reference::ComputeMode mode,
                         Record* record = nullptr);
// The optimized layer's options for the case: its tp / sp (its ranks processes under an MPI launch
// of several), mask type and layer number, on `backend`.
opt::LayerOptions optimized_layer_options(const DenseCase& c, const DenseInputs& in,
                                          rt::Backend backend = rt::Backend::Sim);
// The optimized layer at the case's tp / sp.
Tensor optimized_forward(const DenseCase& c, const DenseInputs& in, const RunOptions& o, Record* record = nullptr);

struct CaseResult {
  std::string id;
  Comparison output;             // optimized vs reference (FP32 mode), bound from the reference's own error
  double reference_error = 0.0;  // max |reference - exact|
  TapDiff taps;                  // with RunOptions::taps: every tap, first divergence named
  double seconds_reference = 0.0, seconds_optimized = 0.0;
  bool pass() const { return output.pass; }
  std::string report() const;  // one paragraph: id, errors, bound, tap table on failure
};
CaseResult run_case(const DenseCase& c, const RunOptions& o = {});

}  // namespace twin::parity
