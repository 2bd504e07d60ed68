// Growable segments: memory that grows and shrinks in place, page by page (the design note is in
// core/growable_segments.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/largest_first.h"
#include "core/memory_source.h"
#include "core/plain_segments.h"

namespace gpumem {

class GrowableSegments final : public MemorySource {
 public:
  static constexpr std::size_t kMaxChunk = std::size_t{256} << 20;  // Note [physical chunks]

  // Where no address range can be had, new memory comes from `plain`. No growable segments until
  // set_page_size gives the backend's mapping granularity. The large pool's growths map chunks of
  // at least `large_chunk` bytes (Note [physical chunks] in growable_segments.cpp).
  GrowableSegments(DeviceState& d, PlainSegments& plain, bool on, std::size_t large_chunk)
      : d_(d), plain_(plain), on_(on), large_chunk_(large_chunk) {}

  // The backend's mapping granularity, 0 where it cannot map pages; set once, before any growth.
  void set_page_size(std::size_t page_size) { page_size_ = page_size; }
  // Whether new memory of `pool` comes from here: the default pool, while asked for and supported;
  // a region's wherever supported (its memory must keep its addresses: core/pause.cpp).
  bool serves(const Pool& pool) const {
    return (in_effect() && &pool == &d_.default_pool) || (supported() && pool.region());
  }
  void set_on(bool on) { on_ = on; }
  void set_large_chunk(std::size_t bytes) { large_chunk_ = bytes; }
  // The chunk the large pool's requests under kChunksPerGrowth of them are mapped in: the least power-of-two
  // number of pages of at least large_chunk; 0 where pages cannot be mapped.
  std::size_t large_chunk() const { return page_size_ > 0 ? chunk_for(false, 0) : 0; }
  bool in_effect() const { return on_ && page_size_ > 0; }
  bool supported() const { return page_size_ > 0; }
  std::size_t page_size() const { return page_size_; }

  // Maps the pages a request lacks at the end of a free block, or in a new address range; where
  // no address range can be had, a plain segment.
  Block* grow(Request& r) override;
  // While the others sharing the GPU give memory back for `r`, which the device refused: maps the
  // whole chunks of the growth grow() would make that `device_free` bytes hold, as cached memory
  // where that growth joins it. Returns the bytes the growth still lacks, 0 once r can be served from
  // the cache. Note [mapping while the others release].
  std::size_t map_ahead(Request& r, std::size_t device_free);
  // The most a growth for `r` maps (whole chunks of its size, however much of it is cached): what
  // the device must hold for it, as an ask of the others counts it.
  std::size_t most_mapped_for(const Request& r) const {
    return round_up(r.size, chunk_for(r.small, round_up(r.size, page_size_)));
  }
  std::size_t growth_for(std::size_t size) const override { return round_up(size, page_size_); }
  // Unmaps free pages, oldest segment first or largest free blocks first (then no more whole chunks
  // than `bytes` needs); nothing while a graph may be capturing. Synchronizes the device once,
  // before the first page goes.
  std::size_t release(std::size_t bytes, ReleaseOrder order) override;
  // Gives back the address ranges with no page mapped.
  void drop_empty() override;
  // Unmaps every chunk of `segment` (a paused region's, its free whole chunks already gone) and
  // files them as paused; returns their bytes. The device must be synchronized. Maps them again
  // at the same addresses, under the cap: false, with nothing of them mapped, where the cap or
  // the device refused (`device_refused` says which).
  std::size_t pause(Segment& segment);
  bool resume(Segment& segment, bool& device_refused);
  // Unmaps the whole chunks inside the cached blocks of `pool`; returns the bytes. The device must
  // be synchronized.
  std::size_t unmap_cached_of(const Pool& pool);
  bool frees_memory(const Block& merged) const override { return holds_free_page(&merged); }
  void drop(const Segment& segment) noexcept override;
  // Blocks the unmapping walks have looked at, ever: what a release or a growth past the high mark
  // costs, for tests.
  std::uint64_t blocks_visited() const { return blocks_visited_; }
  // The high mark's allowance (Note in growable_segments.cpp), for tests: the bytes unmapped to
  // make room there, ever, and the bytes a growth may pass the mark by now.
  std::size_t moved() const { return moved_; }
  std::size_t allowance() const { return allowance_; }

 private:
  static constexpr int kHolesLooked = 16;  // unmapped blocks a growth looks at (choose_unmapped)
  struct Growth {
    Block* block;       // the unmapped block to map from, or nullptr
    std::size_t pages;  // bytes of the pages it needs
  };
  Block* grow_in_chunks(Request& r, std::size_t chunk, bool& no_range);
  Growth choose_unmapped(const Request& r, std::size_t chunk) const;
  bool recycle_before_high_mark(const Growth& growth, StreamId stream, std::size_t fresh);
  static constexpr std::size_t kChunksPerGrowth = 128;  // Note [physical chunks]
  std::size_t chunk_for(bool small, std::size_t bytes) const;
  bool map_chunks(Segment& segment, std::uintptr_t addr, std::size_t bytes);
  std::pair<std::uintptr_t, std::uintptr_t> chunks_inside(const Block* block) const;
  Block* reserve_range(const Request& r, std::size_t chunk);
  Block* map_front(Request& r, Block* unmapped);
  static std::size_t cached_before(const Block* unmapped);
  Block* map_bytes(Request& r, Block* unmapped, std::size_t bytes);
  std::size_t unmap_block(Block* block, std::size_t most = SIZE_MAX);
  bool holds_free_page(const Block* block) const;
  std::vector<Block*> unmappable_blocks() const;
  std::size_t unmap_stream_pages(StreamId stream, std::size_t bytes, std::array<const Block*, 2> keep);
  Block* next_unmappable(StreamId stream, largest_first::Position at, std::array<const Block*, 2> keep) const;
  Block* next_cached(StreamId stream, largest_first::Position at) const;
  std::size_t unmap_until(const std::vector<Block*>& blocks, std::size_t bytes, bool exact);
  void release_range(Segment* segment);

  DeviceState& d_;
  PlainSegments& plain_;
  std::size_t page_size_ = 0;
  bool on_;  // asked for (in effect only if page_size_ > 0)
  std::size_t large_chunk_;
  mutable std::uint64_t blocks_visited_ = 0;
  // The high mark's allowance (Note in growable_segments.cpp): bytes unmapped to make room since
  // the allowance last grew, the bytes a growth may still pass the mark by without that, and the
  // next grant.
  std::size_t remapped_ = 0;
  std::size_t moved_ = 0;
  std::size_t allowance_ = 0;
  std::size_t next_grant_ = 0;
};

}  // namespace gpumem
