// PeerCopy (issue #35 part 2): the ring placement in the rendezvous records, and the transfer of
// per-rank arenas between two real PeerCopy rooms over loopback TCP: a copy arrives and restores
// bit for bit; a transfer cut midway leaves the previous copy; a sender without the job's secret
// is refused and writes nothing; a dead target is retried with a bounded back-off.
#include "agent/peer_copy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/net.h"
#include "efdl/snapshot.h"
#include "rendezvous/protocol.h"
#include "snapshot/arena.h"
#include "snapshot/arena_dir.h"
#include "snapshot/hmac.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;

constexpr const char* kSecret = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

// -- ring placement ------------------------------------------------------------------------------

rdzv::Plan ThreeNodes() {
  rdzv::Plan plan;
  plan.formed = true;
  plan.members = {{"a", 0, 0, 1, "10.0.0.1"}, {"b", 1, 1, 1, "10.0.0.2"},
                  {"c", 2, 2, 1, "10.0.0.3"}};
  return plan;
}

TEST(PeerCopyRingTest, EachMemberCopiesToItsSuccessorAndTheLastToTheFirst) {
  auto ring = rdzv::PeerCopyRing(ThreeNodes(), [](const std::string& id) -> uint16_t {
    return id == "a" ? 7001 : id == "b" ? 7002 : 7003;
  });
  ASSERT_EQ(ring.size(), 3u);
  EXPECT_EQ(ring[0], (rdzv::PeerCopyTarget{"b", "10.0.0.2", 7002}));
  EXPECT_EQ(ring[1], (rdzv::PeerCopyTarget{"c", "10.0.0.3", 7003}));
  EXPECT_EQ(ring[2], (rdzv::PeerCopyTarget{"a", "10.0.0.1", 7001}));
}

TEST(PeerCopyRingTest, NoTargetForOneNodeOrASuccessorWithoutAPort) {
  rdzv::Plan one = ThreeNodes();
  one.members.resize(1);
  EXPECT_EQ(rdzv::PeerCopyRing(one, [](const std::string&) { return uint16_t{7001}; })[0].port,
            0);
  auto ring = rdzv::PeerCopyRing(ThreeNodes(), [](const std::string& id) -> uint16_t {
    return id == "b" ? 0 : 7000;   // b is an older agent
  });
  EXPECT_EQ(ring[0].port, 0);
  EXPECT_EQ(ring[1].port, 7000);
}

TEST(PeerCopyRingTest, RecordsCarryTheFieldsAndOlderRecordsMeanNoPeer) {
  rdzv::AssignRecord a;
  a.round = 4;
  a.peer_copy = {"b", "10.0.0.2", 7002};
  auto back = rdzv::AssignRecord::Decode(a.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->peer_copy, a.peer_copy);
  auto old = rdzv::AssignRecord::Decode(R"({"r":4,"rank":1,"off":1})");
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->peer_copy.port, 0);
  EXPECT_FALSE(rdzv::AssignRecord::Decode(R"({"r":4,"pp":"x"})").ok());

  rdzv::AckRecord ack;
  ack.round = 4;
  ack.peer_copy_port = 7002;
  auto ack_back = rdzv::AckRecord::Decode(ack.Encode());
  ASSERT_TRUE(ack_back.ok());
  EXPECT_EQ(ack_back->peer_copy_port, 7002);
  EXPECT_EQ(rdzv::AckRecord::Decode(R"({"r":4,"st":"ack"})")->peer_copy_port, 0);
}

TEST(PeerCopyWantedTest, OnWithPerRankSnapshotsAndASecretOffWithTheSwitch) {
  auto env = [](const char* value) {
    return [value](const char* name) -> const char* {
      return std::string(name) == "EFDL_PEER_COPY" ? value : nullptr;
    };
  };
  std::string why;
  EXPECT_TRUE(PeerCopyWanted(env(nullptr), true, kSecret, &why));
  EXPECT_TRUE(PeerCopyWanted(env("1"), true, kSecret, &why));
  EXPECT_FALSE(PeerCopyWanted(env("0"), true, kSecret, &why));
  EXPECT_EQ(why, "EFDL_PEER_COPY=0");
  EXPECT_FALSE(PeerCopyWanted(env(nullptr), false, kSecret, &why));
  EXPECT_FALSE(PeerCopyWanted(env(nullptr), true, "", &why));
}

// -- the transfer -------------------------------------------------------------------------------

// A tmpfs of a given size mounted over a directory (root only), unmounted when it goes.
struct TmpfsMount {
  std::string path;
  TmpfsMount() = default;
  TmpfsMount(TmpfsMount&& o) noexcept : path(std::exchange(o.path, {})) {}
  TmpfsMount& operator=(TmpfsMount&&) = delete;
  ~TmpfsMount() {
    if (!path.empty()) ::umount2(path.c_str(), MNT_DETACH);
  }
};

struct Node {
  TempDir shm;
  TmpfsMount mount;   // over shm, when the node has a small one
  std::string holder;
  std::unique_ptr<PeerCopy> pc;
};

// tmpfs_size: the node's shm dir is a tmpfs of that size ("64k"); when it cannot be mounted
// (not root), `mount.path` stays empty and the node has no PeerCopy.
Node MakeNode(const std::string& holder, const std::string& secret,
              std::chrono::milliseconds retry_max = 3000ms, const char* tmpfs_size = nullptr) {
  auto dir = TempDir::Create("efdl-pc-test");
  EXPECT_TRUE(dir.ok());
  Node n{std::move(dir).value(), {}, holder, nullptr};
  if (tmpfs_size != nullptr) {
    const std::string data = std::string("size=") + tmpfs_size + ",mode=0700";
    if (::mount("efdl-pc-test", n.shm.path().c_str(), "tmpfs", 0, data.c_str()) != 0) {
      return n;
    }
    n.mount.path = n.shm.path();
  }
  PeerCopyOptions o;
  o.job_id = "pcjob";
  o.holder = holder;
  o.shm_dir = n.shm.path();
  o.secret = secret;
  o.listen_addr = "127.0.0.1";
  o.min_interval = 50ms;
  o.poll_interval = 20ms;
  o.io_timeout = 3000ms;
  o.retry_max = retry_max;
  auto pc = PeerCopy::Start(o);
  EXPECT_TRUE(pc.ok()) << pc.status().ToString();
  n.pc = std::move(pc).value();
  return n;
}

std::unique_ptr<snapshot::SnapshotEngine> Writer(const Node& n, const std::string& scope) {
  snapshot::EngineOptions o;
  o.job_id = "pcjob";
  o.scope = scope;
  o.arena_path = snapshot::ArenaPath(n.shm.path(), "pcjob", n.holder, scope);
  o.persist = false;
  auto e = snapshot::SnapshotEngine::Open(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  auto engine = std::move(e).value();
  EXPECT_TRUE(engine->SetLayout({{"model/w", "float32", {1024}, 0, 4096}}).ok());
  return engine;
}

uint64_t Commit(snapshot::SnapshotEngine& e, float value, int64_t step) {
  std::vector<float> w(1024, value);
  auto seq = e.Commit({{w.data()}}, step, "{}");
  EXPECT_TRUE(seq.ok()) << seq.status().ToString();
  return seq.ok() ? *seq : 0;
}

std::string PeerPath(const Node& n, const std::string& scope) {
  return snapshot::ArenaPath(n.shm.path(), "pcjob", n.holder, snapshot::PeerArenaScope(scope));
}

// The newest snapshot of a peer arena, restored through a read-only engine as a worker does.
std::optional<std::pair<uint64_t, std::vector<float>>> ReadPeer(const Node& n,
                                                                const std::string& scope) {
  snapshot::EngineOptions o;
  o.job_id = "pcjob";
  o.scope = scope;
  o.arena_path = PeerPath(n, scope);
  o.persist = false;
  auto e = snapshot::SnapshotEngine::Open(o);
  if (!e.ok()) return std::nullopt;
  auto refs = (*e)->Candidates();
  if (refs.empty()) return std::nullopt;
  std::vector<float> w(1024, -1);
  if (!(*e)->Restore(refs.front(), {w.data()}).ok()) return std::nullopt;
  return std::make_pair(refs.front().manifest.seq, w);
}

template <class F>
bool WaitFor(F done, std::chrono::milliseconds limit = 10s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return done();
}

// Node a, writing rank 1 in round 3, copies to its successor b; its first commit (1.5 at step 10,
// seq `seq`) has arrived.
struct FirstCopy {
  Node a;
  Node b;
  std::unique_ptr<snapshot::SnapshotEngine> rank1;
  uint64_t seq = 0;
};

FirstCopy FirstCopyArrived() {
  FirstCopy f{MakeNode("hosta.0", kSecret), MakeNode("hostb.0", kSecret), nullptr, 0};
  f.rank1 = Writer(f.a, "rank1");
  f.a.pc->SetRound(3, 1, 1, {"b", "127.0.0.1", f.b.pc->port()});
  f.seq = Commit(*f.rank1, 1.5f, 10);
  EXPECT_TRUE(WaitFor([&] { return f.b.pc->counts().received >= 1; }));
  return f;
}

TEST(PeerCopyTest, ACopyArrivesOnTheSuccessorAndRestoresBitForBit) {
  auto [a, b, rank1, seq] = FirstCopyArrived();
  ASSERT_EQ(b.pc->counts().received, 1u);
  auto got = ReadPeer(b, "rank1");
  ASSERT_TRUE(got);
  EXPECT_EQ(got->first, seq);
  EXPECT_EQ(got->second, std::vector<float>(1024, 1.5f));
  // A newer commit follows (after the rate limit), into the peer arena's other slot.
  const uint64_t seq2 = Commit(*rank1, 2.5f, 11);
  ASSERT_TRUE(WaitFor([&] {
    auto g = ReadPeer(b, "rank1");
    return g && g->first == seq2;
  }));
  EXPECT_EQ(ReadPeer(b, "rank1")->second, std::vector<float>(1024, 2.5f));
  // Only the ranks the sender writes are copied, and nothing comes back to the sender.
  EXPECT_FALSE(std::filesystem::exists(PeerPath(b, "rank0")));
  EXPECT_FALSE(std::filesystem::exists(PeerPath(a, "rank1")));
  EXPECT_EQ(snapshot::ParseArenaFileName(
                std::filesystem::path(PeerPath(b, "rank1")).filename().string())->scope,
            "peer.rank1");
}

TEST(PeerCopyTest, ASnapshotOfAnEarlierRoundIsNotSentAndKeepsThePreviousPredecessorsCopy) {
  // b keeps c's copy of rank 2 from round 3. In round 4, a (rank 1 again) becomes b's
  // predecessor: a's arena still holds round 3's commit, which it must not send (it would make b
  // drop c's copy before round 4's recovery read it); its first commit of round 4 it sends.
  Node a = MakeNode("hosta.0", kSecret);
  Node b = MakeNode("hostb.0", kSecret);
  Node c = MakeNode("hostc.0", kSecret);
  auto rank2 = Writer(c, "rank2");
  c.pc->SetRound(3, 2, 1, {"b", "127.0.0.1", b.pc->port()});
  Commit(*rank2, 7.0f, 10);
  ASSERT_TRUE(WaitFor([&] { return b.pc->counts().received >= 1; }));
  c.pc.reset();   // c is lost
  auto rank1 = Writer(a, "rank1");
  Commit(*rank1, 1.5f, 10);   // round 3's commit
  std::this_thread::sleep_for(20ms);
  a.pc->SetRound(4, 1, 1, {"b", "127.0.0.1", b.pc->port()});
  std::this_thread::sleep_for(400ms);
  EXPECT_EQ(a.pc->counts().sent, 0u);
  ASSERT_TRUE(ReadPeer(b, "rank2"));
  EXPECT_EQ(ReadPeer(b, "rank2")->second, std::vector<float>(1024, 7.0f));
  // Round 4's first commit goes, and then b keeps the copies of its current predecessor only.
  const uint64_t seq = Commit(*rank1, 2.5f, 11);
  ASSERT_TRUE(WaitFor([&] {
    auto g = ReadPeer(b, "rank1");
    return g && g->first == seq;
  }));
  EXPECT_FALSE(std::filesystem::exists(PeerPath(b, "rank2")));
}

// A client that authenticates like a PeerCopy sender, for the cut transfer below.
int Handshake(uint16_t port, const std::string& secret) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  auto read_frame = [&] {
    uint32_t n = 0;
    EXPECT_EQ(::recv(fd, &n, 4, MSG_WAITALL), 4);
    std::string s(ntohl(n), '\0');
    EXPECT_EQ(::recv(fd, s.data(), s.size(), MSG_WAITALL), static_cast<ssize_t>(s.size()));
    return s;
  };
  auto write_frame = [&](const std::string& s) {
    const uint32_t n = htonl(static_cast<uint32_t>(s.size()));
    EXPECT_EQ(::send(fd, &n, 4, MSG_NOSIGNAL), 4);
    EXPECT_EQ(::send(fd, s.data(), s.size(), MSG_NOSIGNAL), static_cast<ssize_t>(s.size()));
  };
  const std::string hello = read_frame();
  const std::string nonce_s = hello.substr(8);
  const std::string nonce_c(64, '7');
  auto mac = snapshot::HmacSha256Hex(
      secret, "efdl peer copy client\npcjob\n" + nonce_s + "\n" + nonce_c);
  write_frame(nonce_c + *mac);
  read_frame();   // the server's answer
  return fd;
}

TEST(PeerCopyTest, ATransferCutMidwayLeavesThePreviousCopy) {
  auto [a, b, rank1, seq] = FirstCopyArrived();
  ASSERT_EQ(b.pc->counts().received, 1u);
  a.pc->StopSending();
  // A newer snapshot of rank1 whose bytes stop halfway: the connection closes.
  const int fd = Handshake(b.pc->port(), kSecret);
  std::string manifest_text;
  {
    auto arena = snapshot::SnapshotArena::Open(
        snapshot::ArenaPath(a.shm.path(), "pcjob", "hosta.0", "rank1"));
    ASSERT_TRUE(arena.ok());
    auto slot = (*arena)->ReadySlots().front();
    manifest_text.assign(reinterpret_cast<const char*>((*arena)->manifest_area(slot.slot)),
                         slot.manifest_len);
  }
  auto m = snapshot::Manifest::Parse(manifest_text);
  ASSERT_TRUE(m.ok());
  m->seq = seq + 5;
  const std::string text = m->Serialize();
  nlohmann::json head = {{"scope", "rank1"}, {"seq", seq + 5}, {"step", 99},
                         {"ml", text.size()}, {"dl", m->data_bytes}, {"ck", 1},
                         {"round", 3},       {"ranks", {1}}};
  const std::string h = head.dump();
  const uint32_t n = htonl(static_cast<uint32_t>(h.size()));
  ::send(fd, &n, 4, MSG_NOSIGNAL);
  ::send(fd, h.data(), h.size(), MSG_NOSIGNAL);
  ::send(fd, text.data(), text.size(), MSG_NOSIGNAL);
  std::vector<uint8_t> half(m->data_bytes / 2, 0xee);
  ::send(fd, half.data(), half.size(), MSG_NOSIGNAL);
  ::close(fd);
  // The receiver sees the cut; the copy it had is still the newest, intact.
  std::this_thread::sleep_for(300ms);
  auto got = ReadPeer(b, "rank1");
  ASSERT_TRUE(got);
  EXPECT_EQ(got->first, seq);
  EXPECT_EQ(got->second, std::vector<float>(1024, 1.5f));
  EXPECT_EQ(b.pc->counts().received, 1u);
}

TEST(PeerCopyTest, ASenderWithoutTheJobSecretIsRefusedAndWritesNothing) {
  Node b = MakeNode("hostb.0", kSecret);
  Node a = MakeNode("hosta.0",
                    "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210");
  auto rank1 = Writer(a, "rank1");
  a.pc->SetRound(3, 1, 1, {"b", "127.0.0.1", b.pc->port()});
  Commit(*rank1, 1.5f, 10);
  ASSERT_TRUE(WaitFor([&] { return b.pc->counts().refused >= 1; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(b.pc->counts().received, 0u);
  EXPECT_EQ(a.pc->counts().sent, 0u);
  EXPECT_FALSE(std::filesystem::exists(PeerPath(b, "rank1")));
}

// A port on loopback where nothing listens (bound, then closed): a connection there is refused.
uint16_t DeadPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  socklen_t len = sizeof(sa);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

TEST(PeerCopyTest, ADeadTargetIsRetriedWithABoundedBackOff) {
  // Polls every 20 ms; the back-off waits 20, 40, 80 ms, then retry_max (100 ms) each time: in
  // 1.2 s about 14 tries. One per poll, without a back-off: about 60; without its bound
  // (doubling on: 160, 320, 640 ms ...): 6.
  Node a = MakeNode("hosta.0", kSecret, 100ms);
  auto rank1 = Writer(a, "rank1");
  a.pc->SetRound(3, 1, 1, {"b", "127.0.0.1", DeadPort()});
  Commit(*rank1, 1.5f, 10);
  std::this_thread::sleep_for(1200ms);
  const uint64_t failed = a.pc->counts().failed;
  EXPECT_GE(failed, 8u);
  EXPECT_LE(failed, 20u);
  // The next round's successor gets the copy.
  Node b = MakeNode("hostb.0", kSecret);
  a.pc->SetRound(4, 1, 1, {"b", "127.0.0.1", b.pc->port()});
  const uint64_t seq = Commit(*rank1, 2.5f, 11);
  ASSERT_TRUE(WaitFor([&] {
    auto g = ReadPeer(b, "rank1");
    return g && g->first == seq;
  }));
  EXPECT_EQ(ReadPeer(b, "rank1")->second, std::vector<float>(1024, 2.5f));
  EXPECT_TRUE(WaitFor([&] { return a.pc->counts().sent == 1; }));
}

TEST(PeerCopyTest, ACopyWithoutRoomThereIsNeitherSentNorWritten) {
  // b's shm dir is a 64 KiB tmpfs: its peer arena for rank 1 (2 slots, about 150 KiB) does not
  // fit. b answers each header "skip" before the bytes travel: nothing is sent, nothing written.
  Node b = MakeNode("hostb.0", kSecret, 3000ms, "64k");
  if (!b.pc) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  Node a = MakeNode("hosta.0", kSecret);
  auto rank1 = Writer(a, "rank1");
  a.pc->SetRound(3, 1, 1, {"b", "127.0.0.1", b.pc->port()});
  Commit(*rank1, 1.5f, 10);
  ASSERT_TRUE(WaitFor([&] { return b.pc->counts().skipped >= 1; }));
  std::this_thread::sleep_for(60ms);   // past min_interval: the next commit is a mark too
  Commit(*rank1, 2.5f, 11);
  ASSERT_TRUE(WaitFor([&] { return b.pc->counts().skipped >= 2; }));
  EXPECT_EQ(a.pc->counts().bytes_sent, 0u);
  EXPECT_EQ(a.pc->counts().failed, 0u);   // a skip is an answer, not a failure
  EXPECT_EQ(b.pc->counts().received, 0u);
  EXPECT_TRUE(std::filesystem::is_empty(b.shm.path()));
}

}  // namespace
}  // namespace efdl::agent
