// CUDA tensors sent to and received from other processes: the handles' bytes (torch's layouts,
// every supported release's), and two adapters over two simulated devices standing for two
// processes: what a handle names, what the receiver maps and counts, what the sender keeps.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "adapter_fixture.h"
#include "torch/ipc_handle.h"
#include "torch_calls.h"

using namespace gpumem;
using namespace gpumem::testing;

namespace {

constexpr std::size_t kPage = 2 * MiB;

std::string bytes_of(std::size_t n, char fill) { return std::string(n, fill); }

template <typename T>
T read_at(const std::string& s, std::size_t at) {
  T value;
  std::memcpy(&value, s.data() + at, sizeof(T));
  return value;
}

// The receiver's view of what a sender shared: the handle opened on its current device, at the
// offset torch adds.
std::uintptr_t received_at(const std::shared_ptr<void>& base, std::ptrdiff_t offset) {
  return reinterpret_cast<std::uintptr_t>(base.get()) + offset;
}

}  // namespace

// ---- the bytes ----

TEST_CASE("a plain handle is a version byte, 'c' and the 64-byte CUDA handle, and reads back", "[torch][ipc]") {
  const std::string cuda = bytes_of(64, 'x');
  for (int version = 1; version <= 3; ++version) {
    const std::string h = ipc::encode_plain(version, cuda);
    REQUIRE(h.size() == 66);
    REQUIRE(h[0] == static_cast<char>(version));
    REQUIRE(h[1] == 'c');
    const ipc::Handle back = ipc::decode(h);
    REQUIRE(back.kind == ipc::Handle::Kind::kPlain);
    REQUIRE(back.version == version);
    REQUIRE(back.cuda_handle == cuda);
  }
  // torch before the version byte sent the bare CUDA handle
  REQUIRE(ipc::decode(cuda).cuda_handle == cuda);
}

TEST_CASE("chunks of one size make torch's 'e' layout: a 24-byte header before version 3, 32 from it", "[torch][ipc]") {
  const std::vector<int> fds{11, 12, 13};
  const std::vector<std::size_t> sizes(3, 20 * MiB);
  const std::string v2 = ipc::encode_chunks(2, 4242, fds, sizes);
  REQUIRE(v2.size() == 2 + 24 + 3 * 4);
  REQUIRE(v2[1] == 'e');
  REQUIRE(read_at<std::int32_t>(v2, 2) == 4242);
  REQUIRE(read_at<std::uint32_t>(v2, 6) == 0);  // padding is zero: one memory, one string
  REQUIRE(read_at<std::uint64_t>(v2, 10) == 20 * MiB);
  REQUIRE(read_at<std::uint64_t>(v2, 18) == 3);
  REQUIRE(read_at<std::int32_t>(v2, 26) == 11);
  const std::string v3 = ipc::encode_chunks(3, 4242, fds, sizes);
  REQUIRE(v3.size() == 2 + 32 + 3 * 4);
  REQUIRE(read_at<std::int32_t>(v3, 26) == 1);  // the handle kind: file descriptors
  for (const std::string& h : {v2, v3}) {
    const ipc::Handle back = ipc::decode(h);
    REQUIRE(back.kind == ipc::Handle::Kind::kChunks);
    REQUIRE(back.pid == 4242);
    REQUIRE(back.fds == fds);
    REQUIRE(back.bytes == sizes);
    REQUIRE_FALSE(back.fabric);
  }
  REQUIRE(ipc::encode_chunks(2, 4242, fds, sizes) == v2);
}

TEST_CASE("chunks of several sizes make gpumem's 'g' layout, with each chunk's size", "[torch][ipc]") {
  const std::vector<int> fds{5, 6};
  const std::vector<std::size_t> sizes{2 * MiB, 8 * MiB};
  const std::string h = ipc::encode_chunks(2, 77, fds, sizes);
  REQUIRE(h[1] == 'g');
  const ipc::Handle back = ipc::decode(h);
  REQUIRE(back.fds == fds);
  REQUIRE(back.bytes == sizes);
}

TEST_CASE("torch 2.8 to 2.12's fabric handles are told apart by their length", "[torch][ipc]") {
  std::string h;
  h.push_back(2);
  h.push_back('e');
  const std::int32_t pid = 9;
  const std::uint64_t chunk = 20 * MiB, count = 2;
  h.append(reinterpret_cast<const char*>(&pid), 4);
  h.append(4, '\0');
  h.append(reinterpret_cast<const char*>(&chunk), 8);
  h.append(reinterpret_cast<const char*>(&count), 8);
  h.append(2 * 64, 'f');
  const ipc::Handle back = ipc::decode(h);
  REQUIRE(back.fabric);
  REQUIRE(back.bytes.size() == 2);
}

TEST_CASE("a malformed handle is refused naming what is wrong and the forms accepted", "[torch][ipc]") {
  const std::string good = ipc::encode_chunks(2, 1, {3}, {2 * MiB});
  std::string future = good;
  future[0] = 4;
  REQUIRE_THROWS_WITH(ipc::decode(future), Catch::Contains("version 4") && Catch::Contains("newer torch") &&
                                               Catch::Contains("expected a CUDA IPC handle"));
  std::string kind = good;
  kind[1] = 'z';
  REQUIRE_THROWS_WITH(ipc::decode(kind), Catch::Contains("kind byte 122"));
  REQUIRE_THROWS_WITH(ipc::decode(good.substr(0, 12)), Catch::Contains("ends inside its chunk size"));
  REQUIRE_THROWS_WITH(ipc::decode(good + "xx"), Catch::Contains("does not hold the 1 chunks it counts"));
  REQUIRE_THROWS_WITH(ipc::decode("handle"), Catch::Contains("6 bytes"));
  REQUIRE_THROWS_WITH(ipc::decode(""), Catch::Contains("ends inside its version"));
  REQUIRE_THROWS_AS(ipc::encode_chunks(2, 1, {}, {}), std::invalid_argument);
}

// ---- two processes ----

TEST_CASE("a plain segment's tensor is opened by another process, counted under the sender's cap only", "[torch][ipc]") {
  SimAdapter sender(1 * GiB, 1);
  SimAdapter receiver(1 * GiB, 1);
  c10::DataPtr first = sender.adapter.allocate(4 * MiB);
  c10::DataPtr tensor = sender.adapter.allocate(4 * MiB);  // split off the same segment
  const auto shared = sender.adapter.shareIpcHandle(tensor.get());
  REQUIRE(shared.handle[1] == 'c');
  const auto segment = sender.adapter.getBaseAllocation(tensor.get(), nullptr);
  REQUIRE(shared.offset == static_cast<std::ptrdiff_t>(address_of(tensor) - reinterpret_cast<std::uintptr_t>(segment)));
  REQUIRE(sender.backend.ledger(0).exports == 1);

  std::shared_ptr<void> base = receiver.adapter.getIpcDevPtr(shared.handle);
  REQUIRE(base != nullptr);
  REQUIRE(received_at(base, shared.offset) != 0);
  REQUIRE(receiver.backend.ledger(0).imported > 0);
  REQUIRE(receiver.reserved() == 0);  // the sender's memory: no cap of the receiver counts it
  REQUIRE(receiver.backend.ledger(0).in_use == 0);
  // A second storage on the same segment shares what is open: a handle opens once per process.
  std::shared_ptr<void> again = receiver.adapter.getIpcDevPtr(shared.handle);
  REQUIRE(again == base);
  REQUIRE(receiver.adapter.ipc_opened() == 1);
  base.reset();
  REQUIRE(receiver.backend.ledger(0).imported > 0);
  again.reset();
  REQUIRE(receiver.backend.ledger(0).imported == 0);
  REQUIRE(receiver.adapter.ipc_opened() == 0);
}

TEST_CASE("a growable tensor is shared as its chunks' descriptors, kept while the tensor lives", "[torch][ipc]") {
  SimAdapter sender(4 * GiB, 1, kPage);
  SimAdapter receiver(4 * GiB, 1, kPage);
  c10::DataPtr tensor = sender.adapter.allocate(100 * MiB);
  const auto shared = sender.adapter.shareIpcHandle(tensor.get());
  const ipc::Handle h = ipc::decode(shared.handle);
  REQUIRE(h.kind == ipc::Handle::Kind::kChunks);
  REQUIRE(h.pid == static_cast<int>(getpid()));
  std::size_t bytes = 0;
  for (const std::size_t b : h.bytes) bytes += b;
  REQUIRE(bytes >= 100 * MiB);
  REQUIRE(shared.offset >= 0);
  REQUIRE(static_cast<std::size_t>(shared.offset) + 100 * MiB <= bytes);
  REQUIRE(sender.backend.ledger(0).exports == h.fds.size());
  // Shared again: the same descriptors, so the same string, which receivers cache by.
  REQUIRE(sender.adapter.shareIpcHandle(tensor.get()).handle == shared.handle);

  std::shared_ptr<void> base = receiver.adapter.getIpcDevPtr(shared.handle);
  REQUIRE(receiver.backend.ledger(0).imported == bytes);
  REQUIRE(receiver.reserved() == 0);
  const std::size_t reserved = sender.reserved();
  empty_cache(sender.adapter);  // the tensor is live: its chunks stay, exported
  REQUIRE(sender.reserved() == reserved);
  REQUIRE(sender.backend.ledger(0).exports == h.fds.size());
  base.reset();
  REQUIRE(receiver.backend.ledger(0).imported == 0);
  // The tensor's last holder goes (torch keeps it until every receiver let go): its chunks are
  // unmapped at the next release, and their descriptors close with them.
  tensor.clear();
  empty_cache(sender.adapter);
  REQUIRE(sender.reserved() == 0);
  REQUIRE(sender.backend.ledger(0).exports == 0);
}

namespace {

// Widths of a 1B-parameter Llama-like model: the embedding 125 MiB, q/o 8 MiB, gate/up/down 22 MiB,
// each made in fp32 and cast, as randn(...).to(bfloat16) does.
std::vector<c10::DataPtr> weights_of(SimAdapter& sender, const std::vector<std::size_t>& sizes) {
  std::vector<c10::DataPtr> weights;
  for (const std::size_t size : sizes) {
    c10::DataPtr fp32 = sender.adapter.allocate(2 * size);
    weights.push_back(sender.adapter.allocate(size));
  }
  return weights;
}

const std::vector<std::size_t> kWeightSizes{125 * MiB, 8 * MiB, 8 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 8 * MiB, 22 * MiB};

}  // namespace

TEST_CASE("every growable tensor is sent in torch's layout, which native receivers open", "[torch][ipc]") {
  SimAdapter sender(4 * GiB, 1, kPage);
  const std::vector<c10::DataPtr> weights = weights_of(sender, kWeightSizes);
  for (const c10::DataPtr& w : weights) {
    const auto shared = sender.adapter.shareIpcHandle(w.get());
    REQUIRE(shared.handle[1] == 'e');
    const ipc::Handle h = ipc::decode(shared.handle);
    REQUIRE(std::all_of(h.bytes.begin(), h.bytes.end(), [&](std::size_t b) { return b == h.bytes.front(); }));
  }
}

TEST_CASE("with 16 MiB chunks, a model's weights are each sent as a few chunks", "[torch][ipc]") {
  SimAdapter sender(4 * GiB, 1, kPage);
  sender.core_device().set_large_chunk(16 * MiB);
  const std::vector<c10::DataPtr> weights = weights_of(sender, kWeightSizes);
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const auto shared = sender.adapter.shareIpcHandle(weights[i].get());
    REQUIRE(shared.handle[1] == 'e');
    const ipc::Handle h = ipc::decode(shared.handle);
    REQUIRE(h.bytes.front() == 16 * MiB);
    REQUIRE(h.bytes.size() <= (kWeightSizes[i] + 16 * MiB - 1) / (16 * MiB) + 1);
  }
}

TEST_CASE("a tensor cut from cached memory of growths of different sizes is sent in torch's layout", "[torch][ipc]") {
  SimAdapter sender(4 * GiB, 1, kPage);
  SimAdapter receiver(4 * GiB, 1, kPage);
  // 100 MiB maps pages, 2 GiB chunks of 16 MiB (Note [physical chunks]), each in a segment of its
  // chunk; freed, they stay cached, and 2100 MiB grows the 2 GiB.
  c10::DataPtr small = sender.adapter.allocate(100 * MiB);
  c10::DataPtr large = sender.adapter.allocate(2 * GiB);
  small.clear();
  large.clear();
  c10::DataPtr both = sender.adapter.allocate(2100 * MiB);
  const auto shared = sender.adapter.shareIpcHandle(both.get());
  REQUIRE(shared.handle[1] == 'e');
  const ipc::Handle h = ipc::decode(shared.handle);
  REQUIRE(h.bytes.front() == 16 * MiB);
  std::shared_ptr<void> base = receiver.adapter.getIpcDevPtr(shared.handle);
  REQUIRE(receiver.backend.ledger(0).imported >= 2100 * MiB);
}

TEST_CASE("a receiver the platform forbids to import gets an error saying so, and neither side changes", "[torch][ipc]") {
  SimAdapter sender(1 * GiB, 1, kPage);
  SimAdapter receiver(1 * GiB, 1, kPage);
  c10::DataPtr tensor = sender.adapter.allocate(8 * MiB);
  const auto shared = sender.adapter.shareIpcHandle(tensor.get());
  receiver.backend.refuse_imports(true);
  REQUIRE_THROWS_WITH(receiver.adapter.getIpcDevPtr(shared.handle),
                      Catch::Contains("pidfd_getfd failed: Operation not permitted") && Catch::Contains("GPUMEM_SEGMENTS=plain"));
  REQUIRE(receiver.adapter.ipc_opened() == 0);
  REQUIRE(receiver.backend.ledger(0).imported == 0);
  c10::DataPtr more = sender.adapter.allocate(8 * MiB);  // the sender goes on
  REQUIRE(more.get() != nullptr);
  receiver.backend.refuse_imports(false);
  REQUIRE(receiver.adapter.getIpcDevPtr(shared.handle) != nullptr);
}

TEST_CASE("sharing memory gpumem did not allocate names the pointer and changes nothing", "[torch][ipc]") {
  SimAdapter sender(1 * GiB, 1);
  c10::DataPtr tensor = sender.adapter.allocate(4 * MiB);
  void* outside = reinterpret_cast<void*>(0x1234);
  REQUIRE_THROWS_WITH(sender.adapter.shareIpcHandle(outside), Catch::Contains("cannot share 0x1234") &&
                                                                  Catch::Contains("no tensor gpumem allocated"));
  tensor.clear();  // free, cached: not a tensor any more
  REQUIRE_THROWS_WITH(sender.adapter.shareIpcHandle(reinterpret_cast<void*>(address_of(tensor))), Catch::Contains("cannot share"));
  REQUIRE(sender.backend.ledger(0).exports == 0);
}

TEST_CASE("a handle a process made cannot be opened by that process, as CUDA refuses it", "[torch][ipc]") {
  SimAdapter one(1 * GiB, 1);
  c10::DataPtr tensor = one.adapter.allocate(4 * MiB);
  const auto shared = one.adapter.shareIpcHandle(tensor.get());
  REQUIRE_THROWS_WITH(one.adapter.getIpcDevPtr(shared.handle), Catch::Contains("made by this process"));
  REQUIRE(one.adapter.ipc_opened() == 0);
}

TEST_CASE("a malformed handle received is refused as a c10 error with the decoder's message", "[torch][ipc]") {
  SimAdapter receiver(1 * GiB, 1);
  REQUIRE_THROWS_WITH(receiver.adapter.getIpcDevPtr("handle"), Catch::Contains("a CUDA IPC handle of 6 bytes"));
  REQUIRE_THROWS_AS(receiver.adapter.getIpcDevPtr("handle"), c10::Error);
}
