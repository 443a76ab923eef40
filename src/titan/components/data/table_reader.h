// Documents stored as the rows of a table: Apache Parquet files (.parquet: FineWeb, DCLM, the Hugging
// Face Hub's Parquet conversion of every dataset) and Arrow IPC files (.arrow: Hugging Face datasets'
// save_to_disk and cache folders, in the IPC stream format, or the IPC file format), with the text in
// one string column. Read with Apache Arrow's C++ libraries (the ones the pyarrow wheel ships).
//
// Parquet is read one row group at a time, of the text column only; Arrow IPC files are memory-mapped
// and read one record batch at a time. Every batch read is validated in full (offsets within the data,
// UTF-8), so a damaged file is an error naming it, never a crash or garbage text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace titan::data {

// Whether `name` names a table file this reader reads (by its extension: .parquet or .arrow).
bool is_table_file(const std::string& name);

class TableReader {
 public:
  // Opens `path` and finds its column `column` (a string column). UserError naming the file when it
  // is not a readable Parquet / Arrow IPC file or has no such string column.
  TableReader(const std::string& path, const std::string& column);
  ~TableReader();
  TableReader(const TableReader&) = delete;
  TableReader& operator=(const TableReader&) = delete;

  // The next row's text and its 0-based index in the file; false after the last row. A null text is a
  // UserError naming the file and row.
  bool next(std::string& text, int64_t& row);
  // Continues at row `row` (0 <= row <= num_rows()): only the row group or record batch holding it is
  // read again.
  void seek(int64_t row);
  int64_t num_rows() const;
  const std::string& path() const { return path_; }

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace titan::data
