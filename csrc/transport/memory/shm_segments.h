// One rank's POSIX shared-memory segment and this process's mappings of every peer's: the memory
// of the host_shm transport, and of the cuda_host transport once pinned (shared_pinned.h).
//
// Each rank creates one segment laid out by plan::Layout, named
// "/pcie_ar.<pid>.<64-bit random hex>.r<rank>", mode 0600, with its space reserved up front, and
// maps every peer's by name, so a peer's slots and flags are plain pointers.
//
// Nothing outlives its creator in /dev/shm. A segment's name is linked only between its
// creation and unlink() (every peer has mapped it by then); every failure on the way
// (constructor, open_peers, destructor) unlinks it too. A process killed inside that window
// cannot clean up, so the name carries the creator's pid and every new segment first removes the
// names of creators that no longer exist (reclaim_orphaned_segments()).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "plan/layout.h"

namespace pcie_ar::transport {

// Unlinks every /dev/shm entry "pcie_ar.<pid>.*" that this user (effective uid) owns and whose
// creator <pid> no longer exists (kill(pid, 0) fails with ESRCH). Best effort and silent:
// entries of live processes, of other users, or with unparsable names are left alone, and errors
// are ignored. Returns how many names it unlinked. Every ShmSegments constructor calls it.
// Limitation: a pid is only meaningful inside one pid namespace. Containers that share /dev/shm
// (docker --ipc=host, a bind-mounted /dev/shm) but not the pid namespace see each other's pids as
// absent, so a live creator's segment can be unlinked before its peers open it (they then fail to
// connect, loudly; mappings already made are unaffected). Run ranks that share /dev/shm in one
// pid namespace, or give each container its own /dev/shm.
int reclaim_orphaned_segments() noexcept;

// Not thread-safe. Neither copyable nor movable (peers hold pointers into the mappings).
class ShmSegments {
 public:
  // Checks the layout and rank (std::invalid_argument), reclaims orphans, then creates, sizes
  // (layout.total_bytes, reserved: a too-small /dev/shm fails here with a clear error instead of
  // SIGBUS later) and maps this rank's segment and initialises its control area so that the
  // first call uses generation initial_gen + 1. Throws std::runtime_error naming the rank if the
  // segment cannot be created; nothing is left in /dev/shm then.
  ShmSegments(const plan::Layout& layout, int rank, uint32_t initial_gen);
  ~ShmSegments();  // release()
  ShmSegments(const ShmSegments&) = delete;
  ShmSegments& operator=(const ShmSegments&) = delete;

  const plan::Layout& layout() const { return layout_; }
  int rank() const { return rank_; }
  // Our segment's name: what a peer needs to map it.
  const std::string& name() const { return name_; }
  // Rank r's segment as mapped in this process (ours from construction, peers' from
  // open_peers()), or null.
  uint8_t* base(int r) const {
    return r >= 0 && r < static_cast<int>(bases_.size()) ? bases_[r] : nullptr;
  }
  // bases()[r] is base(r), for every rank.
  const std::vector<uint8_t*>& bases() const { return bases_; }

  // Maps every peer's segment; names[r] is rank r's name() and names[rank] must be ours. Throws
  // std::runtime_error naming the peer rank if a segment cannot be opened or its size is not
  // layout.total_bytes (both sizes in the message), std::invalid_argument for a wrong name count
  // or order, std::logic_error if called twice. Every failure but the last unmaps whatever was
  // mapped and unlinks our own name at once: this rank will not reach the barrier, so the
  // connection has failed anyway, and a peer that has not opened us yet fails now.
  void open_peers(const std::vector<std::string>& names);
  // open_peers() for ranks that are threads of this process: maps nothing, but reuses each
  // peer's own mapping of its segment, so the same bytes have one address in the process (what
  // ThreadSanitizer, which tracks memory by address, needs to see every cross-rank access).
  // peers[r] is rank r's segments (peers[rank()] is this one); each must stay alive and keep its
  // segment mapped until this one's close_peers(). Throws std::logic_error if peers are open
  // already, std::invalid_argument for a wrong count, a wrong own entry, or a peer of another
  // layout.
  void open_peers_in_process(const std::vector<const ShmSegments*>& peers);
  // Unlinks our segment's name (every rank has mapped it); mappings stay. Idempotent. Only the
  // creating process unlinks: a forked child that inherited the object never does.
  void unlink() noexcept;
  void close_peers() noexcept;  // unmaps the peers' segments (borrowed ones are only forgotten)
  void release() noexcept;      // close_peers(), then unmaps and unlinks our own segment

 private:
  void create(uint32_t initial_gen);
  void reserve(int fd) const;

  plan::Layout layout_;
  int rank_ = 0;
  pid_t creator_pid_ = 0;  // the process that created the segment (and alone may unlink it)
  std::string name_;
  bool linked_ = false;
  bool peers_open_ = false;
  bool peers_borrowed_ = false;  // peers' bases_ are their owners' mappings: never unmapped here
  std::vector<uint8_t*> bases_;  // bases_[r]: rank r's segment as mapped here (ours included)
};

}  // namespace pcie_ar::transport
