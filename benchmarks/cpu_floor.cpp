// A floor for CPU all-reduce over POSIX shared memory, built by benchmarks/cpu_allreduce.py.
//
// Per call: every rank copies its input into its own shared buffer, barrier, reduces its
// 1/world slice of all ranks' buffers (fp32 accumulation) into its own buffer's slice,
// barrier, copies every rank's reduced slice into the output. Two buffer sets alternate by
// call parity, so a rank may start call n+1 while a peer still copies out of call n's set
// (it cannot reach call n+2's copy-in, which reuses that set, before every peer has arrived
// at call n+1's first barrier, i.e. finished call n). Not a product: no timeouts, no checks
// beyond sizes and dtypes, NaN payloads are not preserved by the bf16 rounding.

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr int kMaxWorld = 16;
constexpr size_t kLine = 64;
constexpr size_t kHeader = 4096;  // kMaxWorld epoch counters, one cache line each

struct alignas(kLine) Epoch {
  std::atomic<uint64_t> value;
};
static_assert(sizeof(Epoch) * kMaxWorld <= kHeader, "header too small");

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int W>
void reduce_f32(float* __restrict out, const float* const* in, size_t n, int world) {
  const int w = W > 0 ? W : world;
  for (size_t i = 0; i < n; ++i) {
    float acc = in[0][i];
    for (int r = 1; r < w; ++r) acc += in[r][i];
    out[i] = acc;
  }
}

template <int W>
void reduce_bf16(uint16_t* __restrict out, const uint16_t* const* in, size_t n, int world) {
  const int w = W > 0 ? W : world;
  for (size_t i = 0; i < n; ++i) {
    float acc = bits_f32(uint32_t(in[0][i]) << 16);
    for (int r = 1; r < w; ++r) acc += bits_f32(uint32_t(in[r][i]) << 16);
    uint32_t x = f32_bits(acc);
    out[i] = uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);  // round to nearest even
  }
}

class Floor {
 public:
  // Rank 0 creates the segment (create=true) before the others attach; the caller unlinks
  // it once everyone has attached.
  Floor(const std::string& name, int64_t rank, int64_t world, int64_t cap_bytes, bool create)
      : name_(name), rank_(int(rank)), world_(int(world)) {
    TORCH_CHECK(world >= 1 && world <= kMaxWorld && rank >= 0 && rank < world, "bad rank/world");
    cap_ = (size_t(cap_bytes) + 4095) / 4096 * 4096;
    bytes_ = kHeader + 2 * size_t(world_) * cap_;
    int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "shm_open ", name, ": ", std::strerror(errno));
    if (create && ftruncate(fd, off_t(bytes_)) != 0) {
      int e = errno;
      close(fd);
      shm_unlink(name.c_str());
      TORCH_CHECK(false, "ftruncate ", name, ": ", std::strerror(e));
    }
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    TORCH_CHECK(p != MAP_FAILED, "mmap ", name, ": ", std::strerror(errno));
    base_ = static_cast<char*>(p);
    epochs_ = reinterpret_cast<Epoch*>(base_);  // zero-filled by ftruncate
  }
  ~Floor() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  void unlink() { shm_unlink(name_.c_str()); }

  void run(const torch::Tensor& inp, torch::Tensor& out) {
    TORCH_CHECK(inp.is_contiguous() && out.is_contiguous() && inp.numel() == out.numel() &&
                    inp.scalar_type() == out.scalar_type() && inp.device().is_cpu(),
                "contiguous CPU tensors of one size and dtype");
    const bool bf16 = inp.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(bf16 || inp.scalar_type() == torch::kFloat32, "bf16 or fp32");
    const size_t elem = bf16 ? 2 : 4;
    const size_t n = size_t(inp.numel());
    TORCH_CHECK(n * elem <= cap_, "tensor larger than the buffer");
    const int set = int(calls_ & 1);
    char* bufs[kMaxWorld];
    for (int r = 0; r < world_; ++r) bufs[r] = buffer(set, r);

    std::memcpy(bufs[rank_], inp.data_ptr(), n * elem);
    barrier(2 * calls_ + 1);

    // Slices are whole cache lines, so no two ranks write one line.
    const size_t per_line = kLine / elem;
    const size_t slice = (n / world_ + per_line - 1) / per_line * per_line;
    auto range = [&](int r, size_t* lo, size_t* len) {
      *lo = std::min(n, slice * size_t(r));
      *len = std::min(n, *lo + slice) - *lo;
    };
    size_t lo, len;
    range(rank_, &lo, &len);
    if (len > 0) {
      if (bf16) {
        const uint16_t* in[kMaxWorld];
        for (int r = 0; r < world_; ++r) in[r] = reinterpret_cast<uint16_t*>(bufs[r]) + lo;
        uint16_t* o = reinterpret_cast<uint16_t*>(bufs[rank_]) + lo;
        switch (world_) {
          case 2:
            reduce_bf16<2>(o, in, len, world_);
            break;
          case 4:
            reduce_bf16<4>(o, in, len, world_);
            break;
          case 8:
            reduce_bf16<8>(o, in, len, world_);
            break;
          default:
            reduce_bf16<0>(o, in, len, world_);
        }
      } else {
        const float* in[kMaxWorld];
        for (int r = 0; r < world_; ++r) in[r] = reinterpret_cast<float*>(bufs[r]) + lo;
        float* o = reinterpret_cast<float*>(bufs[rank_]) + lo;
        switch (world_) {
          case 2:
            reduce_f32<2>(o, in, len, world_);
            break;
          case 4:
            reduce_f32<4>(o, in, len, world_);
            break;
          case 8:
            reduce_f32<8>(o, in, len, world_);
            break;
          default:
            reduce_f32<0>(o, in, len, world_);
        }
      }
    }
    barrier(2 * calls_ + 2);

    char* dst = static_cast<char*>(out.data_ptr());
    for (int i = 0; i < world_; ++i) {
      const int r = (rank_ + i) % world_;  // start with our own slice, spread the readers
      range(r, &lo, &len);
      if (len > 0) std::memcpy(dst + lo * elem, bufs[r] + lo * elem, len * elem);
    }
    ++calls_;
  }

 private:
  char* buffer(int set, int r) const {
    return base_ + kHeader + (size_t(set) * size_t(world_) + size_t(r)) * cap_;
  }

  // Each rank publishes the number of barriers it has reached (monotonic, so reusable
  // without sense reversal) and waits until every rank has reached at least as many.
  void barrier(uint64_t epoch) {
    epochs_[rank_].value.store(epoch, std::memory_order_release);
    for (int r = 0; r < world_; ++r) {
      int polls = 0;
      while (epochs_[r].value.load(std::memory_order_acquire) < epoch) {
        if (++polls < 256) {
          _mm_pause();
        } else {
          sched_yield();  // more ranks than cores: let the peer we wait for run
        }
      }
    }
  }

  std::string name_;
  int rank_;
  int world_;
  size_t cap_ = 0;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  Epoch* epochs_ = nullptr;
  uint64_t calls_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Floor>(m, "Floor")
      .def(pybind11::init<const std::string&, int64_t, int64_t, int64_t, bool>(),
           pybind11::arg("name"), pybind11::arg("rank"), pybind11::arg("world"),
           pybind11::arg("cap_bytes"), pybind11::arg("create"))
      .def("run", &Floor::run, pybind11::arg("inp"), pybind11::arg("out"))
      .def("unlink", &Floor::unlink);
}
