// How a rank's shared-memory segment is named, created, reserved, mapped, unlinked and
// reclaimed; see shm_segments.h.
#include "transport/memory/shm_segments.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>

#include "plan/protocol.h"

namespace pcie_ar::transport {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// Every segment name starts with this (tests/python/conftest.py scans /dev/shm for it), followed
// by the creator's pid and a '.': "/pcie_ar.<pid>.<64-bit random hex>.r<rank>".
constexpr char kSegmentPrefix[] = "pcie_ar.";
// Where glibc's shm_open() keeps its names (Linux).
constexpr char kShmDirectory[] = "/dev/shm";

// The creator pid of a /dev/shm entry named "pcie_ar.<pid>.<anything>", or 0 when the name does
// not have that form (no digits, leading zero, no '.' after them, a pid that cannot be one).
pid_t creator_of(const char* entry) {
  const size_t prefix = sizeof(kSegmentPrefix) - 1;
  if (std::strncmp(entry, kSegmentPrefix, prefix) != 0) return 0;
  const char* p = entry + prefix;
  if (*p < '1' || *p > '9') return 0;  // also rules out pid 0 (kill(0, ...) is our own group)
  long long pid = 0;
  for (; *p >= '0' && *p <= '9'; ++p) {
    pid = pid * 10 + (*p - '0');
    if (pid > 0x7fffffff) return 0;
  }
  if (*p != '.' || p[1] == '\0') return 0;
  return static_cast<pid_t>(pid);
}

std::string make_segment_name(int rank) {
  std::random_device device;
  const uint64_t random = (static_cast<uint64_t>(device()) << 32) ^ device();
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), "/pcie_ar.%ld.%016llx.r%d", static_cast<long>(getpid()),
                static_cast<unsigned long long>(random), rank);
  return buffer;
}
}  // namespace

int reclaim_orphaned_segments() noexcept {
  DIR* dir = opendir(kShmDirectory);
  if (dir == nullptr) return 0;  // not Linux, or no /dev/shm: nothing we can find
  const uid_t me = geteuid();
  int reclaimed = 0;
  while (const dirent* entry = readdir(dir)) {
    const pid_t creator = creator_of(entry->d_name);
    if (creator <= 0) continue;
    struct stat info {};
    if (fstatat(dirfd(dir), entry->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(info.st_mode) || info.st_uid != me) continue;  // never another user's
    // ESRCH only: EPERM means the pid is alive (another user's process, maybe a recycled pid).
    // A zombie still counts as alive until it is reaped. A recycled pid keeps an orphan until
    // that process ends too: leaking for a while is acceptable, unlinking a live segment is not.
    if (kill(creator, 0) == 0 || errno != ESRCH) continue;
    const std::string name = std::string("/") + entry->d_name;
    if (shm_unlink(name.c_str()) == 0) ++reclaimed;
  }
  closedir(dir);
  return reclaimed;
}

ShmSegments::ShmSegments(const plan::Layout& layout, int rank, uint32_t initial_gen)
    : layout_(layout), rank_(rank), creator_pid_(getpid()) {
  plan::check_layout(layout);
  if (rank < 0 || rank >= layout.world) {
    throw std::invalid_argument("rank must be 0.." + std::to_string(layout.world - 1) + ", got " +
                                std::to_string(rank));
  }
  bases_.assign(layout.world, nullptr);
  reclaim_orphaned_segments();
  create(initial_gen);
}

ShmSegments::~ShmSegments() { release(); }

// Sizes our fresh segment and reserves its pages.
void ShmSegments::reserve(int fd) const {
  const auto size = static_cast<off_t>(layout_.total_bytes);
  int truncated = 0;
  do {
    truncated = ftruncate(fd, size);
  } while (truncated != 0 && errno == EINTR);
  if (truncated != 0) {
    const int err = errno;
    throw std::runtime_error("rank " + std::to_string(rank_) + ": ftruncate(" + name_ + ", " +
                             std::to_string(layout_.total_bytes) +
                             " bytes) failed: " + errno_text(err));
  }
  // tmpfs hands out pages lazily; reserving them now turns a too-small /dev/shm (Docker's
  // default is 64 MiB) into this error instead of a SIGBUS in the middle of an all-reduce.
  int reserve = 0;
  do {
    reserve = posix_fallocate(fd, 0, size);
  } while (reserve == EINTR);
  if (reserve != 0 && reserve != EOPNOTSUPP && reserve != EINVAL) {
    throw std::runtime_error("rank " + std::to_string(rank_) + ": cannot reserve " +
                             std::to_string(layout_.total_bytes) + " bytes of shared memory for " +
                             name_ + ": " + errno_text(reserve) +
                             "; enlarge /dev/shm (docker run --shm-size) or lower max_numel");
  }
}

// Creates, sizes and maps our segment under a fresh unique name, then writes its control area.
void ShmSegments::create(uint32_t initial_gen) {
  int fd = -1;
  // 64 random bits make a collision practically impossible; retrying covers the remainder
  // instead of failing on a stale segment from a crashed process with a recycled pid.
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    name_ = make_segment_name(rank_);
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno != EEXIST) {
      const int err = errno;
      throw std::runtime_error("rank " + std::to_string(rank_) + ": shm_open(" + name_ +
                               ") failed: " + errno_text(err) +
                               "; is /dev/shm mounted and writable?");
    }
  }
  if (fd < 0) {
    throw std::runtime_error("rank " + std::to_string(rank_) +
                             ": could not find an unused shared-memory name after 8 attempts");
  }
  linked_ = true;

  try {
    reserve(fd);
    void* base = mmap(nullptr, layout_.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      throw std::runtime_error("rank " + std::to_string(rank_) + ": mmap(" + name_ + ", " +
                               std::to_string(layout_.total_bytes) +
                               " bytes) failed: " + errno_text(err));
    }
    bases_[rank_] = static_cast<uint8_t*>(base);
    close(fd);
    fd = -1;
    plan::initialize_control(base, layout_, initial_gen);
  } catch (...) {
    if (fd >= 0) close(fd);
    if (bases_[rank_] != nullptr) munmap(bases_[rank_], layout_.total_bytes);
    shm_unlink(name_.c_str());
    linked_ = false;
    throw;
  }
}

void ShmSegments::unlink() noexcept {
  if (!linked_) return;
  // A forked child that inherited this object must not unlink its parent's segment.
  if (getpid() == creator_pid_) shm_unlink(name_.c_str());
  linked_ = false;
}

void ShmSegments::open_peers(const std::vector<std::string>& names) {
  if (peers_open_) {
    throw std::logic_error("rank " + std::to_string(rank_) + ": open_peers() was already called");
  }
  // This rank cannot reach the barrier after a failure here: unmap what was mapped and unlink our
  // name now, so nothing is left in /dev/shm even if this object lives on (a Python exception
  // keeps its frame alive), and a peer that has not opened us yet fails at once.
  try {
    if (static_cast<int>(names.size()) != layout_.world) {
      throw std::invalid_argument("open_peers needs one segment name per rank (" +
                                  std::to_string(layout_.world) + "), got " +
                                  std::to_string(names.size()));
    }
    if (names[rank_] != name_) {
      throw std::invalid_argument("open_peers: tokens[" + std::to_string(rank_) + "] is '" +
                                  names[rank_] + "', expected this rank's own segment '" + name_ +
                                  "'; were the names gathered in rank order?");
    }
    close_peers();  // a previous attempt may have failed half-way: start from a clean slate
    for (int peer = 0; peer < layout_.world; ++peer) {
      if (peer == rank_) continue;
      const std::string& peer_name = names[peer];
      const std::string who = "rank " + std::to_string(rank_) + ": rank " + std::to_string(peer) +
                              "'s segment '" + peer_name + "'";
      const int fd = shm_open(peer_name.c_str(), O_RDWR, 0);
      if (fd < 0) {
        const int err = errno;
        throw std::runtime_error(who + " cannot be opened: " + errno_text(err) +
                                 " (was it unlinked before every rank had mapped it?)");
      }
      struct stat info {};
      if (fstat(fd, &info) != 0) {
        const int err = errno;
        close(fd);
        throw std::runtime_error(who + " cannot be inspected: " + errno_text(err));
      }
      if (static_cast<uint64_t>(info.st_size) != layout_.total_bytes) {
        close(fd);
        throw std::runtime_error(who + " holds " + std::to_string(info.st_size) +
                                 " bytes, expected " + std::to_string(layout_.total_bytes) +
                                 " (layout.total_bytes): the ranks built different layouts");
      }
      void* base = mmap(nullptr, layout_.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      const int err = errno;
      close(fd);
      if (base == MAP_FAILED) {
        throw std::runtime_error(who + " cannot be mapped: " + errno_text(err));
      }
      bases_[peer] = static_cast<uint8_t*>(base);
    }
  } catch (...) {
    close_peers();
    unlink();
    throw;
  }
  peers_open_ = true;
}

void ShmSegments::open_peers_in_process(const std::vector<const ShmSegments*>& peers) {
  if (peers_open_) {
    throw std::logic_error("rank " + std::to_string(rank_) + ": open_peers() was already called");
  }
  if (static_cast<int>(peers.size()) != layout_.world || peers[rank_] != this) {
    throw std::invalid_argument("open_peers_in_process needs one workspace per rank (" +
                                std::to_string(layout_.world) + ") with this one at [" +
                                std::to_string(rank_) + "]");
  }
  for (int peer = 0; peer < layout_.world; ++peer) {
    const ShmSegments* other = peers[peer];
    if (other == nullptr || other->rank_ != peer || !(other->layout_ == layout_) ||
        other->bases_[peer] == nullptr) {
      throw std::invalid_argument("open_peers_in_process: entry " + std::to_string(peer) +
                                  " is not rank " + std::to_string(peer) +
                                  "'s live workspace of the same layout");
    }
  }
  close_peers();
  for (int peer = 0; peer < layout_.world; ++peer) {
    if (peer != rank_) bases_[peer] = peers[peer]->bases_[peer];
  }
  peers_borrowed_ = true;
  peers_open_ = true;
}

void ShmSegments::close_peers() noexcept {
  for (int peer = 0; peer < static_cast<int>(bases_.size()); ++peer) {
    if (peer != rank_ && bases_[peer] != nullptr) {
      if (!peers_borrowed_) munmap(bases_[peer], layout_.total_bytes);
      bases_[peer] = nullptr;
    }
  }
  peers_borrowed_ = false;
  peers_open_ = false;
}

void ShmSegments::release() noexcept {
  close_peers();
  if (!bases_.empty() && bases_[rank_] != nullptr) {
    munmap(bases_[rank_], layout_.total_bytes);
    bases_[rank_] = nullptr;
  }
  unlink();
}

}  // namespace pcie_ar::transport
