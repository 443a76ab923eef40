// Text data tokenized together (text_windows.h, TokenizeTogether): members that each encode 1/size of
// every block of documents and exchange the encodings read exactly the single process's stream, save
// and restore the same states, and all stop with the error of a member's bad line. The members run as
// threads here, exchanging through memory; under titan launch they are a node's ranks on a Gloo group
// (the launched training tests compare those runs with one process).
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/data/text_windows.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

namespace titan {
namespace {

// An all-gather over `size` threads: each round collects every member's part, then hands them out.
class MemoryExchange {
 public:
  explicit MemoryExchange(int size) : size_(size), parts_(static_cast<size_t>(size)) {}
  data::TokenizeTogether member(int rank) {
    data::TokenizeTogether t;
    t.rank = rank;
    t.size = size_;
    t.all_gather = [this, rank](const std::vector<int32_t>& mine) { return gather(rank, mine); };
    return t;
  }
  int64_t rounds() const { return round_; }

 private:
  std::vector<std::vector<int32_t>> gather(int rank, const std::vector<int32_t>& mine) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return taken_ == 0; });  // the previous round handed out to everyone
    parts_[static_cast<size_t>(rank)] = mine;
    const int64_t round = round_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      taken_ = size_;
      result_ = parts_;
      ++round_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return round_ != round; });
    }
    std::vector<std::vector<int32_t>> out = result_;
    if (--taken_ == 0) cv_.notify_all();
    return out;
  }
  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<int32_t>> parts_, result_;
  int arrived_ = 0, taken_ = 0;
  int64_t round_ = 0;
};

std::vector<std::string> documents(int n) {
  std::vector<std::string> docs;
  for (int i = 0; i < n; ++i) docs.push_back("doc " + std::to_string(i) + std::string(static_cast<size_t>((i * 13) % 41), 'x'));
  docs[7] = "";
  return docs;
}

// Windows `count` of every member, each member reading its own share of the stream as data-parallel
// rank `rank` of `size` would: the windows it reads, the ones it skips, then its state.
struct MemberRun {
  std::vector<std::vector<int32_t>> windows;
  nlohmann::json state;
  std::string error;
};

std::vector<MemberRun> run_members(const std::vector<std::string>& files, int size, int64_t steps,
                                   const nlohmann::json* start = nullptr, int64_t seq_len = 9) {
  test::ByteTokenizer tok;
  MemoryExchange exchange(size);
  std::vector<MemberRun> runs(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      MemberRun& run = runs[static_cast<size_t>(r)];
      try {
        data::TextWindowSource source(files, "text", tok, seq_len, exchange.member(r));
        if (start) source.load_state(*start);
        std::vector<int32_t> window(static_cast<size_t>(seq_len + 1));
        for (int64_t s = 0; s < steps; ++s) {
          source.skip(r);
          source.read(window.data());
          run.windows.push_back(window);
          source.skip(size - 1 - r);
        }
        run.state = source.state();
      } catch (const UserError& e) {
        run.error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return runs;
}

TEST(DataTokenizeTogether, MembersReadTheSingleProcessStreamAndState) {
  test::TempDir dir;
  const std::vector<std::string> docs = documents(100);
  test::write_file(dir / "a.jsonl", test::jsonl(std::vector<std::string>(docs.begin(), docs.begin() + 60)));
  test::write_file(dir / "b.jsonl", test::jsonl(std::vector<std::string>(docs.begin() + 60, docs.end())));
  const std::vector<std::string> files = {dir / "a.jsonl", dir / "b.jsonl"};
  test::ByteTokenizer tok;
  for (int size : {2, 3, 4}) {
    SCOPED_TRACE("members " + std::to_string(size));
    const int64_t steps = 720 / size;  // 720 windows of 10 tokens: past two epochs of ~2,900 tokens
    const std::vector<MemberRun> together = run_members(files, size, steps);
    // One process reading the same samples.
    data::TextWindowSource single(files, "text", tok, 9);
    std::vector<int32_t> window(10);
    for (int64_t s = 0; s < steps; ++s) {
      for (int r = 0; r < size; ++r) {
        single.read(window.data());
        ASSERT_TRUE(together[static_cast<size_t>(r)].error.empty()) << together[static_cast<size_t>(r)].error;
        EXPECT_EQ(together[static_cast<size_t>(r)].windows[static_cast<size_t>(s)], window) << "step " << s << " rank " << r;
      }
    }
    for (const MemberRun& m : together) EXPECT_EQ(m.state, single.state());
    EXPECT_GE(single.epoch(), 2);
    // Restored mid-stream, the members go on as the single process does.
    const std::vector<MemberRun> resumed = run_members(files, size, 20, &together[0].state);
    for (int64_t s = 0; s < 20; ++s)
      for (int r = 0; r < size; ++r) {
        single.read(window.data());
        ASSERT_TRUE(resumed[static_cast<size_t>(r)].error.empty()) << resumed[static_cast<size_t>(r)].error;
        EXPECT_EQ(resumed[static_cast<size_t>(r)].windows[static_cast<size_t>(s)], window) << "resumed step " << s;
      }
  }
}

TEST(DataTokenizeTogether, EachMemberEncodesItsShareOfTheDocuments) {
  test::TempDir dir;
  test::write_file(dir / "d.jsonl", test::jsonl(documents(64)));
  // A tokenizer that counts what it encodes.
  struct Counting : test::ByteTokenizer {
    mutable std::mutex mu;
    mutable std::map<std::thread::id, int64_t> docs;
    std::vector<int32_t> encode(std::string_view text, bool bos, bool eos) const override {
      std::lock_guard<std::mutex> lock(mu);
      ++docs[std::this_thread::get_id()];
      return test::ByteTokenizer::encode(text, bos, eos);
    }
  } tok;
  const int size = 4;
  MemoryExchange exchange(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      data::TextWindowSource source({dir / "d.jsonl"}, "text", tok, 9, exchange.member(r));
      std::vector<int32_t> window(10);
      for (int i = 0; i < 40; ++i) source.read(window.data());  // 400 tokens: within the first block
    });
  for (auto& t : threads) t.join();
  // One block of 256 x 4 documents (the 64 of the file, 16 times over), 256 encoded by each member.
  ASSERT_EQ(tok.docs.size(), 4u);
  for (const auto& [id, n] : tok.docs) EXPECT_EQ(n, data::TextWindowSource::kDocsPerMember);
  EXPECT_EQ(exchange.rounds(), 1);
}

TEST(DataTokenizeTogether, AMembersBadLineStopsEveryMemberWithItsError) {
  test::TempDir dir;
  std::string text = test::jsonl(documents(40));
  text += "{\"text\": broken}\n";  // document 40: member 40 % 3 = 1 extracts it
  test::write_file(dir / "d.jsonl", text);
  const std::vector<MemberRun> runs = run_members({dir / "d.jsonl"}, 3, 30);
  for (const MemberRun& m : runs) {
    EXPECT_NE(m.error.find("d.jsonl:41: malformed JSON"), std::string::npos) << m.error;
  }
}

}  // namespace
}  // namespace titan
