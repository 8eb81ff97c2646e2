// Fuzzes the safetensors reader: its bytes come from files anyone can hand to `twin inspect` or
// `twin fixture`, and its header states sizes and offsets that index into the data. The contract
// (core/safetensors.h): any malformed image is a SafetensorsError; a successful parse yields
// tensors whose bytes lie inside the image. Everything else (crash, sanitizer report, another
// exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/safetensors.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    // The borrowing overload: tensors point into libFuzzer's buffer, which is exactly `size`
    // bytes, so ASan catches any read past the image.
    const twin::SafetensorsFile f = twin::read_safetensors_bytes("fuzz.safetensors", nullptr, data, size);
    std::size_t total = 0;
    for (const auto& name : f.names()) {
      const twin::Tensor& t = f.at(name);
      total += t.nbytes();
      if (t.nbytes() > size) twin::fuzz::finding("a tensor is larger than the file");
      // Read every value of the small ones (the large ones are bounded by the check above).
      if (t.numel() <= (1 << 14)) (void)t.to_f64();
      (void)t.describe();
    }
    if (total > size) twin::fuzz::finding("tensors hold more bytes than the file");
    for (const auto& [k, v] : f.metadata()) (void)f.meta(k);
  } catch (const twin::SafetensorsError&) {
    // Documented answer to a malformed image.
  } catch (const std::exception& e) {
    twin::fuzz::unexpected_exception(e);
  }
  return 0;
}
