// How a request becomes a block size, a pool and a segment size (sizing.h), first as functions and
// then as the segments the allocator actually reserves from the simulated device.
#include "helpers.h"

using namespace gpumem_test;

// ---- block sizes ------------------------------------------------------------------------------

TEST_CASE("a request below 512 bytes gets a 512-byte block", "[sizing]") {
  REQUIRE(round_size(0) == 512);
  REQUIRE(round_size(1) == 512);
  REQUIRE(round_size(511) == 512);
  REQUIRE(round_size(512) == 512);
}

TEST_CASE("a request is rounded up to a multiple of 512 bytes", "[sizing]") {
  REQUIRE(round_size(513) == 1024);
  REQUIRE(round_size(1000) == 1024);
  REQUIRE(round_size(1024) == 1024);
  REQUIRE(round_size(1025) == 1536);
  REQUIRE(round_size(MiB + 1) == MiB + 512);
  REQUIRE(round_size(10 * MiB - 1) == 10 * MiB);
}

TEST_CASE("the allocator hands out blocks of the rounded size and remembers the request", "[sizing]") {
  Sim sim;
  Block* b = sim.malloc(1000);
  REQUIRE(b->size == 1024);
  REQUIRE(b->requested == 1000);
  Block* c = sim.malloc(1);
  REQUIRE(c->size == 512);
  REQUIRE(c->requested == 1);
  REQUIRE(c->addr % 512 == 0);
  REQUIRE(c->addr == b->addr + 1024);
}

// ---- pools ------------------------------------------------------------------------------------

TEST_CASE("blocks up to 1 MiB come from the small pool", "[sizing]") {
  REQUIRE(is_small(512));
  REQUIRE(is_small(MiB));
  REQUIRE_FALSE(is_small(MiB + 512));

  Sim sim;
  Block* b = sim.malloc(MiB);
  const SegmentInfo s = sim.segment_of(b);
  REQUIRE(s.small);
  REQUIRE(s.size == 2 * MiB);
}

TEST_CASE("a block of 1 MiB plus one byte comes from the large pool", "[sizing]") {
  Sim sim;
  Block* b = sim.malloc(MiB + 1);
  REQUIRE(b->size == MiB + 512);
  const SegmentInfo s = sim.segment_of(b);
  REQUIRE_FALSE(s.small);
  REQUIRE(s.size == 20 * MiB);
}

// ---- segment sizes ----------------------------------------------------------------------------

TEST_CASE("small-pool segments are 2 MiB", "[sizing]") {
  REQUIRE(segment_size(512) == 2 * MiB);
  REQUIRE(segment_size(MiB) == 2 * MiB);
}

TEST_CASE("blocks of 1 to 10 MiB get a 20 MiB segment", "[sizing]") {
  REQUIRE(segment_size(MiB + 512) == 20 * MiB);
  REQUIRE(segment_size(5 * MiB) == 20 * MiB);
  REQUIRE(segment_size(10 * MiB - 512) == 20 * MiB);
}

TEST_CASE("blocks of 10 MiB and more get their own segment rounded up to 2 MiB", "[sizing]") {
  REQUIRE(segment_size(10 * MiB) == 10 * MiB);
  REQUIRE(segment_size(10 * MiB + 512) == 12 * MiB);
  REQUIRE(segment_size(21 * MiB) == 22 * MiB);
  REQUIRE(segment_size(22 * MiB) == 22 * MiB);
}

TEST_CASE("the tight segment is the smallest that holds the block", "[sizing]") {
  REQUIRE(tight_segment_size(512) == 2 * MiB);
  REQUIRE(tight_segment_size(MiB) == 2 * MiB);
  REQUIRE(tight_segment_size(MiB + 512) == 2 * MiB);
  REQUIRE(tight_segment_size(3 * MiB) == 4 * MiB);
  REQUIRE(tight_segment_size(21 * MiB) == 22 * MiB);
}

TEST_CASE("the allocator reserves segments of the normal size", "[sizing]") {
  Sim sim;
  const std::size_t requests[] = {100, MiB, 3 * MiB, 10 * MiB, 21 * MiB};
  const std::size_t segments[] = {2 * MiB, 2 * MiB, 20 * MiB, 10 * MiB, 22 * MiB};
  for (int i = 0; i < 5; ++i) {
    // A separate stream each, so no request can be served from an earlier segment.
    Block* b = sim.malloc(requests[i], static_cast<StreamId>(i + 1));
    INFO("request " << requests[i]);
    REQUIRE(sim.segment_of(b).size == segments[i]);
  }
  REQUIRE(sim.ledger().reserves == 5);
  REQUIRE(sim.ledger().in_use == 56 * MiB);
}

TEST_CASE("a tight segment is reserved when the normal one would pass the limit", "[sizing][cap]") {
  Sim sim(10 * MiB);
  Block* b = sim.malloc(3 * MiB);  // normally a 20 MiB segment
  REQUIRE(sim.segment_of(b).size == 4 * MiB);
  REQUIRE(sim.ledger().in_use == 4 * MiB);
  REQUIRE(sim.ledger().reserves == 1);
  REQUIRE(sim.ledger().refusals == 0);  // the cap said no to 20 MiB; the device was never asked
}

TEST_CASE("the normal segment is used when it fits under the limit exactly", "[sizing][cap]") {
  Sim sim(20 * MiB);
  Block* b = sim.malloc(3 * MiB);
  REQUIRE(sim.segment_of(b).size == 20 * MiB);
  REQUIRE(sim.ledger().in_use == 20 * MiB);
}

TEST_CASE("a tight segment is reserved when the device refuses the normal one", "[sizing][oom]") {
  Sim sim;
  sim.backend.fail_when([](int, std::size_t bytes) { return bytes == 20 * MiB; });
  Block* b = sim.malloc(5 * MiB);
  REQUIRE(sim.segment_of(b).size == 6 * MiB);
  REQUIRE(sim.ledger().refusals == 1);
  REQUIRE(sim.ledger().in_use == 6 * MiB);
}

TEST_CASE("round_to_division rounds up to the next of N equal steps between powers of two", "[sizing]") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  // 84 MiB lies between 64 and 128 MiB: steps of 16 MiB with 4 divisions, 8 MiB with 8.
  REQUIRE(round_to_division(84 * MiB, 4) == 96 * MiB);
  REQUIRE(round_to_division(84 * MiB, 8) == 88 * MiB);
  REQUIRE(round_to_division(400 * MiB, 2) == 512 * MiB);
  REQUIRE(round_to_division(80 * MiB, 4) == 80 * MiB);   // on a step already
  REQUIRE(round_to_division(64 * MiB, 4) == 64 * MiB);   // a power of two
  REQUIRE(round_to_division(3000, 1) == 4096);           // one division: the next power of two
}
