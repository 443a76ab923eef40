// Checkpoints at scale, on their own: replicated pieces written in balance by every replica, a
// folder rank 0 cannot see refused before the index is written, an index that holds no slices (a
// reader reads only the slice indexes it needs), names read from files that must be plain file
// names, a full save that keeps an export of the same step, and tensors streamed through a bounded
// host buffer written byte for byte as a direct write.
#include "fake_ranks.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/checkpoint/file_io.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace titan::checkpoint {
namespace {

namespace fs = std::filesystem;


nlohmann::json info() { return {{"step", 1}, {"model", {{"name", "toy"}, {"flavor", "x"}}}, {"contents", {"model"}}}; }

// A model's worth of tensors of mixed sizes (as a transformer's: big matrices, small norms), whole on
// every rank and replicated over "dp_replicate" (DDP).
std::vector<dist::PlacedTensor> replicated_model(int seed) {
  at::manual_seed(seed);
  std::vector<dist::PlacedTensor> out;
  for (int layer = 0; layer < 6; ++layer) {
    for (const auto& [name, rows, cols] : {std::tuple{"wq", 64, 64}, std::tuple{"w1", 160, 64},
                                           std::tuple{"w2", 64, 160}, std::tuple{"norm", 1, 64}}) {
      at::Tensor t = at::randn({rows, cols});
      out.push_back({"model.layers." + std::to_string(layer) + "." + name, t, dist::whole(t, {"dp_replicate"})});
    }
  }
  at::Tensor emb = at::randn({256, 64});
  out.push_back({"model.tok_embeddings.weight", emb, dist::whole(emb, {"dp_replicate"})});
  return out;
}

std::map<std::string, int64_t> rank_file_bytes(const fs::path& dir) {
  std::map<std::string, int64_t> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") out[e.path().filename().string()] = static_cast<int64_t>(e.file_size());
  return out;
}

TEST(CheckpointScale, EveryReplicaWritesAboutTheSameBytesAndEveryPieceOnce) {
  for (const int replicas : {2, 3, 4}) {
    SCOPED_TRACE(std::to_string(replicas) + " replicas");
    test::TempDir dir;
    std::vector<std::string> all(static_cast<size_t>(replicas));
    int64_t total = 0, largest = 0;
    for (int r = replicas - 1; r >= 0; --r) {
      auto tensors = replicated_model(7);
      assign_writers(tensors, [&](const std::string& dim) {
        EXPECT_EQ(dim, "dp_replicate");
        return std::pair<int, int>(r, replicas);
      });
      if (r == 0)
        for (const auto& t : tensors) {
          total += t.local.numel() * 4;
          largest = std::max<int64_t>(largest, t.local.numel() * 4);
        }
      Snapshot snap = take_snapshot(tensors);
      snap.info = info();
      FakeRanks coord(r, replicas, &all);
      write((dir / "step-1"), snap, coord);
    }
    // Every replica wrote a file, within one largest tensor of an equal share.
    const auto bytes = rank_file_bytes(dir / "step-1");
    ASSERT_EQ(bytes.size(), static_cast<size_t>(replicas));
    for (const auto& [file, b] : bytes) EXPECT_LE(std::abs(b - total / replicas), largest + 4096) << file;
    // And the checkpoint reads back whole (every piece written exactly once: the index checks it too).
    Reader reader((dir / "step-1"));
    reader.verify_all();
    for (const auto& t : replicated_model(7))
      EXPECT_TRUE(at::equal(reader.read(t.name, {0, 0}, t.local.sizes().vec()), t.local)) << t.name;
  }
}

TEST(CheckpointScale, PiecesReplicatedOverTwoDimensionsAreBalancedOverBoth) {
  // A norm replicated over tp (2) and dp_replicate (2): 4 holders; each writes a quarter of 8 norms.
  std::vector<int> writes(4, 0);
  for (int tp = 0; tp < 2; ++tp)
    for (int rep = 0; rep < 2; ++rep) {
      std::vector<dist::PlacedTensor> tensors;
      for (int i = 0; i < 8; ++i) {
        at::Tensor t = at::zeros({64});
        tensors.push_back({"model.layers." + std::to_string(i) + ".norm", t, dist::whole(t, {"tp", "dp_replicate"})});
      }
      assign_writers(tensors, [&](const std::string& dim) {
        return dim == "tp" ? std::pair<int, int>(tp, 2) : std::pair<int, int>(rep, 2);
      });
      for (const auto& t : tensors) writes[static_cast<size_t>(tp * 2 + rep)] += t.placement.primary;
    }
  EXPECT_EQ(writes, (std::vector<int>{2, 2, 2, 2}));
}

TEST(CheckpointScale, AFileRankZeroCannotSeeFailsTheSaveBeforeTheIndexNamingTheSharedFolderRequirement) {
  test::TempDir dir;
  std::vector<std::string> all(2);
  at::Tensor t = at::ones({4, 4});
  auto part = [&](int rank) {
    dist::Placement p;
    p.global_shape = {8, 4};
    p.shards.push_back(dist::chunk("dp_shard", 0, 8, rank, 2));
    Snapshot snap = take_snapshot({{"model.w", t, p}});
    snap.info = info();
    return snap;
  };
  // Rank 1 writes into its own folder (as on a node-local disk): rank 0 does not see its files.
  FakeRanks one(1, 2, &all), zero(0, 2, &all);
  write((dir / "node1/step-1"), part(1), one);
  try {
    write((dir / "node0/step-1"), part(0), zero);
    FAIL() << "a save whose files rank 0 cannot see completed";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank-00001.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("file system that every rank shares"), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(dir / "node0/step-1"));
  EXPECT_FALSE(fs::exists(dir / "node0/step-1.partial/index.json"));
}

TEST(CheckpointScale, TheIndexHoldsNoSlicesAndAReaderReadsOnlyTheSliceIndexesItNeeds) {
  test::TempDir dir;
  const int world = 4;
  std::vector<std::string> all(world);
  at::manual_seed(3);
  const at::Tensor a = at::randn({8, 3}), b = at::randn({4});
  for (int r = world - 1; r >= 0; --r) {
    std::vector<dist::PlacedTensor> tensors;
    dist::Placement pa;
    pa.global_shape = {8, 3};
    pa.shards.push_back(dist::chunk("dp_shard", 0, 8, r, world));
    tensors.push_back({"model.a", a.narrow(0, 2 * r, 2).contiguous(), pa});
    if (r == 0) tensors.push_back({"model.b", b, dist::whole(b)});  // on rank 0 only
    Snapshot snap = take_snapshot(tensors);
    snap.info = info();
    FakeRanks coord(r, world, &all);
    write((dir / "step-1"), snap, coord);
  }
  const nlohmann::json index = nlohmann::json::parse(read_file((dir / "step-1/index.json")));
  EXPECT_EQ(index.at("version"), 2);
  EXPECT_EQ(index.dump().find("crc32\":", index.dump().find("\"tensors\"")), std::string::npos)
      << "the index lists slices: " << index.dump();
  EXPECT_EQ(index.at("tensors").at("model.a").at("shards"), nlohmann::json::parse("[[0, 4]]"));
  EXPECT_EQ(index.at("tensors").at("model.b").at("shards"), nlohmann::json::parse("[[0, 1]]"));
  // Reading model.b needs rank 0's slice index only.
  Reader reader((dir / "step-1"));
  const int64_t index_only = reader.index_bytes_read();
  EXPECT_TRUE(at::equal(reader.read("model.b", {0}, {4}), b));
  const int64_t slice_index = static_cast<int64_t>(fs::file_size(dir / "step-1/rank-00000.slices.json"));
  EXPECT_EQ(reader.index_bytes_read(), index_only + slice_index);
  EXPECT_TRUE(at::equal(reader.read("model.a", {3, 0}, {4, 3}), a.narrow(0, 3, 4)));
  EXPECT_TRUE(at::equal(reader.read("model.a", {0, 0}, {8, 3}), a));
  // Rank 0 learned each rank's file from a 256-byte record, and read one slice index per distinct
  // contents (rank 0's, and one of ranks 1-3, which hold the same tensors).
  EXPECT_EQ(last_index_cost().slice_index_bytes_read,
            slice_index + static_cast<int64_t>(fs::file_size(dir / "step-1/rank-00001.slices.json")));
  // A damaged slice index is caught by its CRC-32, naming it.
  {
    std::string text = read_file((dir / "step-1/rank-00002.slices.json"));
    text[text.find("\"crc32\":") + 8] ^= 1;
    std::ofstream((dir / "step-1/rank-00002.slices.json"), std::ios::binary) << text;
  }
  Reader damaged((dir / "step-1"));
  try {
    damaged.read("model.a", {0, 0}, {8, 3});
    FAIL() << "a damaged slice index was read";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("rank-00002.slices.json is corrupt"), std::string::npos) << e.what();
  }
}

using ::titan::test::error_of;

TEST(CheckpointScale, NamesReadFromFilesMustBePlainFileNames) {
  test::TempDir dir;
  write_single_process((dir / "step-1"), {{"model.a", at::ones({4})}}, info());
  const std::string good = read_file((dir / "step-1/index.json"));
  fs::create_directories(dir / "outside");
  for (const std::string bad : {"../outside/x", "/etc/passwd", "..", "a\\\\b"}) {
    SCOPED_TRACE(bad);
    // A data file named in the index (its shards list), and a file entry.
    std::string text = good;
    text.replace(text.find("\"part-00000\""), 12, "\"" + bad + "\"");
    std::ofstream((dir / "step-1/index.json")) << text;
    std::string e = error_of([&] { Reader r((dir / "step-1")); });
    EXPECT_NE(e.find("is not a plain file name"), std::string::npos) << e;
  }
  std::ofstream((dir / "step-1/index.json")) << good;
  // A slice index whose data file climbs out of the folder.
  {
    std::string text = read_file((dir / "step-1/part-00000.slices.json"));
    text.replace(text.find("\"part-00000.safetensors\""), 24, "\"../part-00000.safetensors\"");
    std::ofstream((dir / "step-1/part-00000.slices.json")) << text;
    nlohmann::json index = nlohmann::json::parse(good);
    index["files"]["part-00000.slices.json"] = {{"bytes", text.size()}, {"crc32", string_crc32(text)}};
    std::ofstream((dir / "step-1/index.json")) << index.dump();
    Reader r((dir / "step-1"));
    std::string e = error_of([&] { r.read("model.a", {0}, {4}); });
    EXPECT_NE(e.find("is not a plain file name"), std::string::npos) << e;
  }
  // A version-1 index whose slice names a file outside.
  {
    nlohmann::json v1 = {{"format", "titan-checkpoint"}, {"version", 1}, {"info", info()}, {"state", nlohmann::json::object()},
                         {"files", nlohmann::json::object()},
                         {"tensors", {{"model.a", {{"dtype", "F32"}, {"shape", {4}}, {"slices", {{{"file", "../x.safetensors"},
                           {"begin", {0}}, {"length", {4}}, {"crc32", 0}}}}}}}}};
    v1["info_state_crc32"] = string_crc32(v1["info"].dump() + "\n" + v1["state"].dump());
    fs::create_directories(dir / "v1");
    std::ofstream((dir / "v1/index.json")) << v1.dump();
    std::string e = error_of([&] { Reader r((dir / "v1")); });
    EXPECT_NE(e.find("'../x.safetensors', which is not a plain file name"), std::string::npos) << e;
  }
}

TEST(CheckpointScale, AHuggingFaceWeightMapNamingAFileOutsideItsFolderIsRefused) {
  test::TempDir dir;
  fs::create_directories(dir / "hf");
  std::ofstream((dir / "hf/config.json")) << model_spec("llama3").hf_adapter("debugmodel").config_json(at::kFloat);
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", {{"model.norm.weight", "../../etc/passwd"}}}};
  std::ofstream((dir / "hf/model.safetensors.index.json")) << index.dump();
  const std::string e = error_of([&] { HFSource s((dir / "hf"), model_spec("llama3"), "debugmodel"); });
  EXPECT_NE(e.find("'../../etc/passwd', which is not a plain file name"), std::string::npos) << e;
}

TEST(CheckpointScale, AFullSaveAtAStepHoldingAnExportMovesTheExportAsideAndSaysSo) {
  test::TempDir dir;
  config::Checkpoint cfg;
  cfg.enable = true;
  std::vector<std::string> logs;
  Checkpointer ck(cfg, dir.path(), single_process_coordinator(), [&](const std::string& m) { logs.push_back(m); });
  // A model-only export of step 4 (an earlier run's last save), then this run's full save of step 4.
  Snapshot model_only = take_snapshot({{"model.a", at::full({4}, 1.0f), dist::whole(at::zeros({4}))}});
  model_only.info = info();
  ck.save(4, model_only);
  Snapshot full = take_snapshot({{"model.a", at::full({4}, 2.0f), dist::whole(at::zeros({4}))}});
  full.info = {{"step", 4}, {"model", info()["model"]}, {"contents", {"model", "train_state"}}};
  ck.save(4, full);
  ASSERT_TRUE(fs::exists(dir / "step-4.export/index.json"));
  EXPECT_EQ(Reader((dir / "step-4.export")).read("model.a", {0}, {4})[0].item<float>(), 1.0f);
  EXPECT_EQ(Reader((dir / "step-4")).read("model.a", {0}, {4})[0].item<float>(), 2.0f);
  bool said = false;
  for (const auto& l : logs) said = said || l.find("moved it to " + (dir / "step-4.export")) != std::string::npos;
  EXPECT_TRUE(said);
  // A full checkpoint of the same step is replaced, as documented (a run that resumed before it).
  ck.save(4, full);
  EXPECT_FALSE(fs::exists(dir / "step-4.export.2"));
}

TEST(CheckpointScale, TensorsStreamedThroughABoundedBufferAreWrittenByteForByte) {
  test::TempDir dir;
  at::manual_seed(1);
  const std::vector<SafetensorsEntry> entries = {{"a", at::randn({37, 11})}, {"b", at::randint(0, 9, {5}, at::kLong)},
                                                 {"c", at::zeros({0})}};
  const auto direct = write_safetensors((dir / "direct.safetensors"), entries, {{"format", "pt"}});
  WriteOptions streamed;
  streamed.stream_cpu = true;
  streamed.host_buffer_bytes = 100;  // several chunks per tensor
  const auto chunked = write_safetensors((dir / "chunked.safetensors"), entries, {{"format", "pt"}}, streamed);
  EXPECT_EQ(read_file((dir / "direct.safetensors")), read_file((dir / "chunked.safetensors")));
  EXPECT_EQ(direct.crc32, chunked.crc32);
  EXPECT_EQ(direct.entry_crc32, chunked.entry_crc32);
  // Stored in another dtype: cast chunk by chunk, the same bytes as casting the whole tensor first.
  const at::Tensor a = entries[0].data;
  write_safetensors((dir / "whole_cast.safetensors"), {{"a", a.to(at::kBFloat16)}}, {});
  write_safetensors((dir / "chunk_cast.safetensors"), {{"a", a, at::kBFloat16}}, {}, streamed);
  EXPECT_EQ(read_file((dir / "whole_cast.safetensors")), read_file((dir / "chunk_cast.safetensors")));
}

TEST(CheckpointScale, ASynchronousExportInAnotherDtypeReferencesTheLiveTensorsAndCastsWhileWriting) {
  test::TempDir dir;
  const at::Tensor w = at::randn({64, 8});
  SnapshotOptions o;
  o.copy = false;
  o.cast_floats_to = at::kBFloat16;
  Snapshot snap = take_snapshot({{"model.w", w, dist::whole(w)}}, o);
  ASSERT_EQ(snap.slices.size(), 1u);
  EXPECT_EQ(snap.slices[0].data.data_ptr(), w.data_ptr()) << "a host copy of the whole tensor was made";
  snap.info = info();
  auto coord = single_process_coordinator();
  write((dir / "step-1"), snap, *coord);
  Reader r((dir / "step-1"));
  ASSERT_EQ(r.meta("model.w")->dtype, at::kBFloat16);
  EXPECT_TRUE(at::equal(r.read("model.w", {0, 0}, {64, 8}), w.to(at::kBFloat16)));
}

}  // namespace
}  // namespace titan::checkpoint
