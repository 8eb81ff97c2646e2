// NCCL collectives (GPU only): all-reduce, all-gather and all-to-all over every visible GPU (one
// rank per GPU, ncclCommInitAll), each checked against a direct computation.
#include "optimized/runtime/collectives.h"
#include "tests/optimized/runtime/gpu_fixture.h"

#include <cuda_runtime_api.h>

#include <vector>

TEST_F(GpuTest, NcclCollectivesOverAllVisibleGpus) {
  int ngpu = 0;
  ASSERT_EQ(cudaGetDeviceCount(&ngpu), cudaSuccess);
  std::vector<int> devices(ngpu);
  for (int i = 0; i < ngpu; ++i) devices[i] = i;
  auto comms = twin::rt::make_nccl_group(devices);
  const std::size_t count = 1000;
  std::vector<std::vector<float>> ar(ngpu), ag(ngpu);
  std::vector<std::vector<std::int32_t>> a2a(ngpu);
  twin::rt::run_ranks(ngpu, [&](int r) {
    ASSERT_EQ(cudaSetDevice(devices[r]), cudaSuccess);
    twin::rt::Device& d = twin::rt::device(twin::rt::Backend::Cuda);
    twin::rt::Stream s(d);
    std::vector<float> x(count);
    for (std::size_t i = 0; i < count; ++i)
      x[i] = static_cast<float>(r * 1000 + static_cast<int>(i % 17));  // integers: exact sums
    twin::rt::DeviceBuffer dx(d, count * 4), dy(d, count * 4), dg(d, count * 4 * ngpu);
    dx.upload(x.data(), count * 4, s.handle());
    comms[r]->all_reduce(dx.get(), dy.get(), count, twin::DType::F32, s.handle());
    comms[r]->all_gather(dx.get(), dg.get(), count, twin::DType::F32, s.handle());
    // all_to_all: rank r sends q + 1 elements (value 100 * r + q) to rank q.
    std::vector<std::size_t> sc(ngpu), rc(ngpu);
    std::vector<std::int32_t> send;
    std::size_t total = 0;
    for (int q = 0; q < ngpu; ++q) {
      sc[q] = q + 1;
      rc[q] = r + 1;
      total += rc[q];
      for (int i = 0; i <= q; ++i) send.push_back(100 * r + q);
    }
    twin::rt::DeviceBuffer ds(d, send.size() * 4), dr(d, total * 4);
    ds.upload(send.data(), send.size() * 4, s.handle());
    comms[r]->all_to_all(ds.get(), sc, dr.get(), rc, twin::DType::I32, s.handle());
    ar[r].resize(count);
    ag[r].resize(count * ngpu);
    a2a[r].resize(total);
    dy.download(ar[r].data(), count * 4, s.handle());
    dg.download(ag[r].data(), count * 4 * ngpu, s.handle());
    dr.download(a2a[r].data(), total * 4, s.handle());
  });
  for (int r = 0; r < ngpu; ++r) {
    for (std::size_t i = 0; i < count; ++i) {
      float sum = 0;
      for (int q = 0; q < ngpu; ++q) sum += static_cast<float>(q * 1000 + static_cast<int>(i % 17));
      ASSERT_EQ(ar[r][i], sum) << "rank " << r << " element " << i;
      for (int q = 0; q < ngpu; ++q)
        ASSERT_EQ(ag[r][q * count + i], static_cast<float>(q * 1000 + static_cast<int>(i % 17)));
    }
    std::size_t k = 0;
    for (int q = 0; q < ngpu; ++q)
      for (int i = 0; i <= r; ++i) ASSERT_EQ(a2a[r][k++], 100 * q + r) << "rank " << r;
  }
}
