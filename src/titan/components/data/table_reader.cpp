// The only translation unit that sees Arrow's headers (they are large): the rest of titan uses the
// TableReader of table_reader.h.
#include "titan/components/data/table_reader.h"

#include "titan/common/error.h"

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/io/memory.h>
#include <arrow/ipc/reader.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/schema.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <parquet/properties.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

namespace titan::data {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

enum class Format { kParquet, kIpcFile, kIpcStream };

// By the first bytes: Parquet files start with "PAR1", Arrow IPC files with "ARROW1"; anything else is
// taken for an IPC stream (which starts with a message), and its reader says whether it is one.
Format format_of(const std::string& path) {
  char magic[6] = {};
  std::FILE* f = std::fopen(path.c_str(), "rb");
  TITAN_USER_CHECK(f, "cannot open dataset file '", path, "': ", std::strerror(errno));
  const size_t n = std::fread(magic, 1, sizeof magic, f);
  std::fclose(f);
  if (n >= 4 && std::memcmp(magic, "PAR1", 4) == 0) return Format::kParquet;
  if (n == 6 && std::memcmp(magic, "ARROW1", 6) == 0) return Format::kIpcFile;
  TITAN_USER_CHECK(!ends_with(path, ".parquet"), "dataset file '", path, "' is not a Parquet file (it does not start with "
                   "the bytes PAR1): is it damaged, or misnamed?");
  return Format::kIpcStream;
}

const char* format_name(Format f) {
  return f == Format::kParquet ? "Parquet" : f == Format::kIpcFile ? "Arrow IPC file" : "Arrow IPC stream";
}

bool is_text_type(const arrow::DataType& t) {
  return t.id() == arrow::Type::STRING || t.id() == arrow::Type::LARGE_STRING || t.id() == arrow::Type::STRING_VIEW;
}

std::string column_list(const std::vector<std::shared_ptr<arrow::Field>>& fields) {
  std::string out;
  for (const auto& f : fields) out += (out.empty() ? "" : ", ") + f->name() + " (" + f->type()->ToString() + ")";
  return out.empty() ? "none" : out;
}

}  // namespace

bool is_table_file(const std::string& name) { return ends_with(name, ".parquet") || ends_with(name, ".arrow"); }

struct TableReader::Impl {
  std::string path, column;
  Format format = Format::kParquet;

  // Parquet: the reader, the text column's leaf index, the rows of each row group.
  std::unique_ptr<parquet::arrow::FileReader> parquet;
  int leaf = -1;
  // Arrow IPC: the mapped file, the text column's index in the schema, and the reader.
  std::shared_ptr<arrow::io::MemoryMappedFile> mapped;
  int field = -1;
  std::shared_ptr<arrow::ipc::RecordBatchFileReader> ipc_file;
  std::shared_ptr<arrow::ipc::RecordBatchStreamReader> ipc_stream;
  std::shared_ptr<arrow::Buffer> whole;  // IPC stream: the whole mapping (zero-copy)

  // The rows of each unit (row group, record batch) and the first row of each; for a stream these are
  // known once it has been read through (counted on first need).
  std::vector<int64_t> unit_rows, unit_start;
  bool counted = false;

  // The unit being read: its index, first row, text column (its chunks), and the next row to return.
  int64_t unit = -1;       // -1 before the first
  std::vector<std::shared_ptr<arrow::Array>> chunks;
  size_t chunk = 0;
  int64_t in_chunk = 0;
  int64_t next_row = 0;
  int64_t stream_units = 0;  // IPC stream: record batches read from the current stream reader

  // Runs an Arrow / Parquet call, turning its failures (exceptions) into a UserError naming the file.
  template <typename F>
  auto guard(const char* what, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const UserError&) {
      throw;
    } catch (const std::exception& e) {
      fail(what, e.what());
    }
  }
  void check(const arrow::Status& s, const char* what) {
    if (!s.ok()) fail(what, s.ToString());
  }
  [[noreturn]] void fail(const char* what, std::string message) {
    std::replace(message.begin(), message.end(), '\n', ' ');  // Arrow's messages may span lines
    while (!message.empty() && (message.back() == ' ' || message.back() == '.')) message.pop_back();
    throw UserError("dataset file '" + path + "' (" + format_name(format) + "): " + what + " failed (" + message +
                    "): is the file damaged or truncated?");
  }
  template <typename T>
  T value(arrow::Result<T> r, const char* what) {
    check(r.status(), what);
    return std::move(r).ValueUnsafe();
  }

  void open() {
    format = format_of(path);
    if (format == Format::kParquet) {
      std::shared_ptr<arrow::io::ReadableFile> file = value(arrow::io::ReadableFile::Open(path), "opening");
      parquet::ReaderProperties props = parquet::default_reader_properties();
      props.set_page_checksum_verification(true);  // pages written with checksums are checked
      guard("reading the footer", [&] {
        parquet::arrow::FileReaderBuilder builder;
        check(builder.Open(file, props), "reading the footer");
        builder.memory_pool(arrow::default_memory_pool());
        // Reads in this thread: pre-buffering would read ahead on Arrow's IO thread pool, whose tasks can
        // outlive the reader (and hold its file open), beside training's threads.
        parquet::ArrowReaderProperties arrow_props = parquet::default_arrow_reader_properties();
        arrow_props.set_pre_buffer(false);
        arrow_props.set_use_threads(false);
        builder.properties(arrow_props);
        parquet = value(builder.Build(), "reading the schema");
      });
      const auto& fields = parquet->manifest().schema_fields;
      std::vector<std::shared_ptr<arrow::Field>> all;
      for (const auto& f : fields) all.push_back(f.field);
      const parquet::arrow::SchemaField* found = nullptr;
      for (const auto& f : fields)
        if (f.field->name() == column) found = &f;
      TITAN_USER_CHECK(found, "dataset file '", path, "' has no column '", column, "' (columns: ", column_list(all),
                       "): set training.dataset_text_field (validation.dataset_text_field for validation data; in a dataset_mix entry, text_field=FIELD after the path) to the column holding the text");
      TITAN_USER_CHECK(found->is_leaf() && is_text_type(*found->field->type()), "dataset file '", path, "': column '",
                       column, "' is ", found->field->type()->ToString(), ", expected a string column");
      leaf = found->column_index;
      std::shared_ptr<parquet::FileMetaData> meta = parquet->parquet_reader()->metadata();
      for (int g = 0; g < meta->num_row_groups(); ++g)
        unit_rows.push_back(guard("reading the row group metadata", [&] { return meta->RowGroup(g)->num_rows(); }));
      counted = true;
    } else {
      mapped = value(arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ), "memory-mapping");
      if (format == Format::kIpcStream) {
        // A stream's writer ends it with an end-of-stream marker (0xFFFFFFFF then a zero length, or the
        // zero length alone before Arrow 0.15): a stream cut between two batches would otherwise read
        // as a complete, shorter one.
        const int64_t size = value(mapped->GetSize(), "reading the size");
        bool ends = false;
        if (size >= 4) {
          const auto tail = value(mapped->ReadAt(size - std::min<int64_t>(size, 8), std::min<int64_t>(size, 8)), "mapping");
          const uint8_t* t = tail->data();
          const int64_t n = tail->size();
          static const uint8_t kZero[4] = {0, 0, 0, 0};
          ends = std::memcmp(t + n - 4, kZero, 4) == 0;
        }
        TITAN_USER_CHECK(ends, "dataset file '", path, "' is damaged or truncated: an Arrow IPC stream that does not "
                         "end with its end-of-stream marker (cut short by an interrupted copy or write?); copy or write "
                         "it again");
      }
      std::shared_ptr<arrow::Schema> schema = open_ipc(-1);
      field = schema->GetFieldIndex(column);
      TITAN_USER_CHECK(field >= 0, "dataset file '", path, "' has no column '", column, "' (columns: ",
                       column_list(schema->fields()), "): set training.dataset_text_field (validation.dataset_text_field for validation data; in a dataset_mix entry, text_field=FIELD after the path) to the column holding the text");
      TITAN_USER_CHECK(is_text_type(*schema->field(field)->type()), "dataset file '", path, "': column '", column,
                       "' is ", schema->field(field)->type()->ToString(), ", expected a string column");
      open_ipc(field);
      if (format == Format::kIpcFile) {
        for (int i = 0; i < ipc_file->num_record_batches(); ++i) unit_rows.push_back(-1);  // counted on need
      }
    }
  }

  // A reader of the IPC stream from its start, of the schema field `only` (all when -1): each reads the
  // mapping through a buffer of its own, so a second one (to count rows) leaves the first in place.
  std::shared_ptr<arrow::ipc::RecordBatchStreamReader> new_stream(int only) {
    arrow::ipc::IpcReadOptions options = arrow::ipc::IpcReadOptions::Defaults();
    options.use_threads = false;  // no Arrow thread pool beside training (compressed batches decode here)
    if (only >= 0) options.included_fields = {only};
    return guard("reading the schema", [&] {
      if (!whole) {
        const int64_t size = value(mapped->GetSize(), "reading the size");
        whole = value(mapped->ReadAt(0, size), "mapping");
      }
      return value(arrow::ipc::RecordBatchStreamReader::Open(std::make_shared<arrow::io::BufferReader>(whole), options),
                   "reading the schema");
    });
  }

  // (Re)opens the IPC reader at the start, reading only the schema field `only` (all when -1).
  std::shared_ptr<arrow::Schema> open_ipc(int only) {
    if (format == Format::kIpcStream) {
      ipc_stream = new_stream(only);
      stream_units = 0;
      return ipc_stream->schema();
    }
    arrow::ipc::IpcReadOptions options = arrow::ipc::IpcReadOptions::Defaults();
    options.use_threads = false;  // no Arrow thread pool beside training (compressed batches decode here)
    if (only >= 0) options.included_fields = {only};
    return guard("reading the schema", [&] {
      ipc_file = value(arrow::ipc::RecordBatchFileReader::Open(mapped, options), "reading the schema");
      return ipc_file->schema();
    });
  }

  // The rows of every unit, for seeking (and num_rows): Parquet has them in its footer; record batches
  // are read for them (zero-copy from the mapping, not validated: only their lengths are used).
  void count() {
    if (counted) return;
    if (format == Format::kIpcFile) {
      for (int i = 0; i < static_cast<int>(unit_rows.size()); ++i)
        unit_rows[i] = value(guard("reading a record batch", [&] { return ipc_file->ReadRecordBatch(i); }),
                             "reading a record batch")->num_rows();
    } else {
      std::shared_ptr<arrow::ipc::RecordBatchStreamReader> counter = new_stream(field);
      for (;;) {
        std::shared_ptr<arrow::RecordBatch> batch;
        guard("reading a record batch", [&] { check(counter->ReadNext(&batch), "reading a record batch"); });
        if (!batch) break;
        unit_rows.push_back(batch->num_rows());
      }
    }
    counted = true;
  }

  void starts() {
    count();
    if (unit_start.size() == unit_rows.size()) return;
    unit_start.assign(unit_rows.size(), 0);
    for (size_t i = 1; i < unit_rows.size(); ++i) unit_start[i] = unit_start[i - 1] + unit_rows[i - 1];
  }

  int64_t total_rows() {
    starts();
    return unit_rows.empty() ? 0 : unit_start.back() + unit_rows.back();
  }

  // Loads unit `u` (its text column, validated in full); false when the file has no such unit.
  bool load(int64_t u) {
    chunks.clear();
    chunk = 0;
    in_chunk = 0;
    std::shared_ptr<arrow::ChunkedArray> column_data;
    if (format == Format::kParquet) {
      if (u >= static_cast<int64_t>(unit_rows.size())) return false;
      std::shared_ptr<arrow::Table> table = guard("reading a row group", [&] {
        return value(parquet->ReadRowGroup(static_cast<int>(u), {leaf}), "reading a row group");
      });
      TITAN_USER_CHECK(table->num_columns() == 1 && table->num_rows() == unit_rows[u], "dataset file '", path,
                       "': row group ", u, " read as ", table->num_rows(), " rows of ", table->num_columns(),
                       " column(s), its metadata says ", unit_rows[u], " rows: is the file damaged?");
      column_data = table->column(0);
    } else {
      std::shared_ptr<arrow::RecordBatch> batch;
      if (format == Format::kIpcFile) {
        if (u >= static_cast<int64_t>(unit_rows.size())) return false;
        batch = value(guard("reading a record batch", [&] { return ipc_file->ReadRecordBatch(static_cast<int>(u)); }),
                      "reading a record batch");
      } else {
        if (u < stream_units) open_ipc(field);  // backwards: from the start again
        while (stream_units <= u) {
          guard("reading a record batch", [&] { check(ipc_stream->ReadNext(&batch), "reading a record batch"); });
          if (!batch) return false;
          ++stream_units;
        }
      }
      TITAN_USER_CHECK(batch->num_columns() == 1, "dataset file '", path, "': record batch ", u, " has ",
                       batch->num_columns(), " columns, expected the text column only");
      // Rows are numbered by the batch's row count (count()) and read by its column: they must agree.
      TITAN_USER_CHECK(batch->column(0)->length() == batch->num_rows() &&
                           (u >= static_cast<int64_t>(unit_rows.size()) || unit_rows[u] < 0 || unit_rows[u] == batch->num_rows()),
                       "dataset file '", path, "': record batch ", u, " says ", batch->num_rows(),
                       " rows but its text column holds ", batch->column(0)->length(), ": is the file damaged?");
      column_data = std::make_shared<arrow::ChunkedArray>(batch->column(0));
    }
    TITAN_USER_CHECK(is_text_type(*column_data->type()), "dataset file '", path, "': column '", column, "' is ",
                     column_data->type()->ToString(), " in ", format == Format::kParquet ? "row group " : "record batch ",
                     u, ", expected a string column");
    check(column_data->ValidateFull(), format == Format::kParquet ? "validating a row group" : "validating a record batch");
    for (const auto& c : column_data->chunks())
      if (c->length() > 0) chunks.push_back(c);
    unit = u;
    return true;
  }

  bool next(std::string& text, int64_t& row) {
    while (chunk >= chunks.size())
      if (!load(unit + 1)) return false;
    const arrow::Array& a = *chunks[chunk];
    TITAN_USER_CHECK(!a.IsNull(in_chunk), "dataset file '", path, "', row ", next_row, " (counting from 0): the text "
                     "column '", column, "' is null; remove the row or fill in its text");
    std::string_view v;
    switch (a.type_id()) {
      case arrow::Type::STRING: v = static_cast<const arrow::StringArray&>(a).GetView(in_chunk); break;
      case arrow::Type::LARGE_STRING: v = static_cast<const arrow::LargeStringArray&>(a).GetView(in_chunk); break;
      default: v = static_cast<const arrow::StringViewArray&>(a).GetView(in_chunk); break;
    }
    text.assign(v.data(), v.size());
    row = next_row++;
    if (++in_chunk == a.length()) {
      ++chunk;
      in_chunk = 0;
    }
    return true;
  }

  void seek(int64_t row) {
    const int64_t total = total_rows();
    TITAN_USER_CHECK(row >= 0 && row <= total, "dataset file '", path, "' has ", total, " rows, fewer than the saved "
                     "position (row ", row, "): was it changed since the checkpoint was written?");
    // The unit holding `row`: the last one starting at or before it (empty units before it start there too).
    int64_t u = std::upper_bound(unit_start.begin(), unit_start.end(), row) - unit_start.begin() - 1;
    chunks.clear();
    chunk = 0;
    in_chunk = 0;
    next_row = row;
    if (row == total || u < 0) {  // at the end: the next read finds no unit after the last
      unit = static_cast<int64_t>(unit_rows.size()) - 1;
      return;
    }
    TITAN_ASSERT(load(u), "row group / record batch ", u, " of '", path, "' vanished");
    int64_t skip = row - unit_start[u];
    while (skip > 0) {
      TITAN_USER_CHECK(chunk < chunks.size(), "dataset file '", path, "': ",
                       format == Format::kParquet ? "row group " : "record batch ", u, " holds fewer rows than its "
                       "count: is the file damaged?");
      const int64_t left = chunks[chunk]->length() - in_chunk;
      if (skip < left) {
        in_chunk += skip;
        break;
      }
      skip -= left;
      ++chunk;
      in_chunk = 0;
    }
  }
};

TableReader::TableReader(const std::string& path, const std::string& column) : path_(path), impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->column = column;
  impl_->open();
}

TableReader::~TableReader() = default;

bool TableReader::next(std::string& text, int64_t& row) { return impl_->next(text, row); }

void TableReader::seek(int64_t row) { impl_->seek(row); }

int64_t TableReader::num_rows() const { return impl_->total_rows(); }

}  // namespace titan::data
