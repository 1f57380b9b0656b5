#include "server/backends/vmm_arena.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <map>
#include <mutex>
#include <vector>

namespace kvpack::server {
namespace {

// The driver functions the arena needs, resolved once at run time.
struct DriverApi {
  decltype(&cuMemGetAllocationGranularity) get_granularity = nullptr;
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;

  bool Load(std::string* why) {
    constexpr unsigned kVersion = 12000;  // the VMM entry points' ABI since CUDA 12.0
    const auto load = [&](const char* name, auto* fn) {
      void* ptr = nullptr;
      cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
      if (cudaGetDriverEntryPointByVersion(name, &ptr, kVersion, cudaEnableDefault, &result) != cudaSuccess ||
          result != cudaDriverEntryPointSuccess || ptr == nullptr) {
        *why = std::string("driver entry point ") + name + " not found";
        return false;
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(ptr);
      return true;
    };
    return load("cuMemGetAllocationGranularity", &get_granularity) &&
           load("cuMemAddressReserve", &address_reserve) && load("cuMemAddressFree", &address_free) &&
           load("cuMemCreate", &create) && load("cuMemRelease", &release) && load("cuMemMap", &map) &&
           load("cuMemUnmap", &unmap) && load("cuMemSetAccess", &set_access);
  }
};

class VmmArena final : public Arena {
 public:
  VmmArena(const DriverApi& api, const VmmArenaOptions& options, CUmemAllocationProp prop, uint64_t chunk,
           CUdeviceptr base, uint64_t reserve)
      : api_(api), options_(options), prop_(prop), chunk_(chunk), base_(base), reserve_(reserve),
        chunks_(reserve / chunk) {
    free_spans_[0] = reserve;
  }

  ~VmmArena() override {
    for (uint64_t i = 0; i < chunks_.size(); ++i) {
      if (chunks_[i].mapped) UnmapChunk(i);
    }
    api_.address_free(base_, reserve_);
  }

  void* Allocate(uint64_t bytes) override {
    if (bytes == 0) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    auto span = free_spans_.begin();
    while (span != free_spans_.end() && span->second < bytes) ++span;
    if (span == free_spans_.end()) return nullptr;
    const uint64_t offset = span->first;
    const uint64_t rest = span->second - bytes;
    free_spans_.erase(span);
    if (rest > 0) free_spans_[offset + bytes] = rest;
    for (uint64_t i = offset / chunk_; i <= (offset + bytes - 1) / chunk_; ++i) {
      if (!chunks_[i].mapped) {
        if (!MapChunk(i)) {
          ReleaseRange(offset, bytes, /*end_chunk=*/i);
          return nullptr;
        }
      } else if (chunks_[i].users == 0) {
        --idle_chunks_;  // kept mapped since its last user left
      }
      ++chunks_[i].users;
    }
    return reinterpret_cast<void*>(base_ + offset);
  }

  void Free(void* ptr, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t offset = reinterpret_cast<CUdeviceptr>(ptr) - base_;
    ReleaseRange(offset, bytes, (offset + bytes - 1) / chunk_ + 1);
  }

  void Trim() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t i = 0; i < chunks_.size() && idle_chunks_ > 0; ++i) {
      if (mapped_chunks_ * chunk_ <= options_.keep_mapped_bytes) return;
      if (chunks_[i].mapped && chunks_[i].users == 0) {
        UnmapChunk(i);
        --idle_chunks_;
      }
    }
  }

  // Lock-free: Allocate holds mu_ while it maps chunks (~0.1 ms each, tens of ms for a large
  // request), and Status and /metrics must not wait for that.
  uint64_t MappedBytes() const override { return mapped_chunks_.load(std::memory_order_relaxed) * chunk_; }

 private:
  struct Chunk {
    CUmemGenericAllocationHandle handle = 0;
    bool mapped = false;
    int users = 0;
  };

  bool MapChunk(uint64_t i) {
    Chunk& c = chunks_[i];
    if (api_.create(&c.handle, chunk_, &prop_, 0) != CUDA_SUCCESS) return false;
    const CUdeviceptr at = base_ + i * chunk_;
    if (api_.map(at, chunk_, 0, c.handle, 0) != CUDA_SUCCESS) {
      api_.release(c.handle);
      return false;
    }
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (api_.set_access(at, chunk_, &access, 1) != CUDA_SUCCESS) {
      api_.unmap(at, chunk_);
      api_.release(c.handle);
      return false;
    }
    c.mapped = true;
    ++mapped_chunks_;
    return true;
  }

  void UnmapChunk(uint64_t i) {
    Chunk& c = chunks_[i];
    api_.unmap(base_ + i * chunk_, chunk_);
    api_.release(c.handle);
    c = Chunk{};
    --mapped_chunks_;
  }

  // Drops one user from chunks [first chunk of offset, end_chunk) and returns the span to the free
  // list. Chunks that fall idle stay mapped until Trim(): mapping and unmapping the ~360 chunks of a
  // 750 MB request costs tens of milliseconds per call, which back-to-back requests then skip.
  void ReleaseRange(uint64_t offset, uint64_t bytes, uint64_t end_chunk) {
    for (uint64_t i = offset / chunk_; i < end_chunk; ++i) {
      if (--chunks_[i].users == 0) ++idle_chunks_;
    }
    auto [it, inserted] = free_spans_.emplace(offset, bytes);
    auto next = std::next(it);
    if (next != free_spans_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_spans_.erase(next);
    }
    if (it != free_spans_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_spans_.erase(it);
      }
    }
  }

  const DriverApi api_;
  const VmmArenaOptions options_;
  CUmemAllocationProp prop_;
  const uint64_t chunk_;
  const CUdeviceptr base_;
  const uint64_t reserve_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_spans_;  // offset → bytes, coalesced
  std::vector<Chunk> chunks_;
  std::atomic<uint64_t> mapped_chunks_{0};  // written under mu_, read without it (MappedBytes)
  uint64_t idle_chunks_ = 0;  // mapped with no users
};

}  // namespace

std::unique_ptr<Arena> MakeVmmArena(const VmmArenaOptions& options, std::string* why) {
  DriverApi api;
  if (!api.Load(why)) return nullptr;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = options.device;
  size_t granularity = 0;
  if (api.get_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS ||
      granularity == 0) {
    *why = "cuMemGetAllocationGranularity failed: no VMM support";
    return nullptr;
  }
  const uint64_t chunk = granularity;
  const uint64_t reserve = (options.reserve_bytes + chunk - 1) / chunk * chunk;
  CUdeviceptr base = 0;
  if (reserve == 0 || api.address_reserve(&base, reserve, chunk, 0, 0) != CUDA_SUCCESS) {
    *why = "cuMemAddressReserve of " + std::to_string(reserve) + " bytes failed";
    return nullptr;
  }
  return std::make_unique<VmmArena>(api, options, prop, chunk, base, reserve);
}

}  // namespace kvpack::server
