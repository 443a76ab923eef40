// Streaming reader of the documents of text data, one file after another:
//   - JSON Lines files (one JSON object per line, c4-style) holding the document text in one string
//     field, optionally compressed with gzip (.gz) or zstd (.zst);
//   - Parquet (.parquet) and Arrow IPC (.arrow) files holding it in one string column (table_reader.h).
//
// Files are read in chunks (lines), row groups or record batches, never whole. Compression is
// recognized by the file's magic bytes, so the extension only matters for which files of a folder are
// listed (see list_data_files) and for telling table files from JSON Lines. A line that is not a JSON
// object, or lacks the text field, is a user error naming file and line (a table file's missing
// column or null text, file and row): titan stops rather than silently training on less data. Blank
// lines are skipped; an empty text (a row's, or a JSON object's) is a document.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace titan::data {

// The data files of `path`: the file itself, or the files of a folder (recursively, following links)
// whose names end in .json / .jsonl (optionally followed by .gz or .zst), .parquet or .arrow, sorted by
// their path relative to the folder. Hugging Face's metadata files (dataset_info.json,
// dataset_infos.json, dataset_dict.json, state.json) and hidden files and folders are not data.
//   - A Hugging Face Hub cache folder (datasets--org--name, holding snapshots/<rev>/ and refs/main) is
//     read as its snapshot named by refs/main (or its only snapshot).
//   - A dataset repository whose README.md declares configurations (hub_configs.h) is narrowed to the
//     split's files of the configuration load_dataset reads by default (the only one, the one marked
//     default, the one named "default", or for allenai/c4 "en"); none of them: UserError.
//   - Otherwise a clone of allenai/c4 (a folder with en/c4-train.*.json.gz) is narrowed to en/c4-<split>.*.
//   - Otherwise, when some files belong to split `split` ("train" or "validation"), only those are
//     read: a file belongs to split S when a folder or file name of its relative path equals S or
//     starts with S followed by one of "-._" or a digit, or its file name contains "-S-" or "-S.".
// Throws UserError when the path does not exist or a folder holds no data file.
std::vector<std::string> list_data_files(const std::string& path, const std::string& split = "train");

// Where a document starts: which pass over the files (epoch), which file, the byte offset of its line
// in the decompressed file and that line's 1-based number (for error messages after a resume); in a
// table file, offset is the row's 0-based index in the file and line is offset + 1.
struct DocPos {
  int64_t epoch = 0;
  int64_t file = 0;
  int64_t offset = 0;
  int64_t line = 1;
  bool operator==(const DocPos&) const = default;
};

// Sequential reader of one decompressed file as lines. seek() on a compressed file re-decompresses from
// the start and discards the bytes before the offset.
class LineReader {
 public:
  explicit LineReader(const std::string& path);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // The next line without its '\n' (and '\r'); false at the end of the file. `offset` / `line_no` are
  // those of the returned line.
  bool next(std::string& line, int64_t& offset, int64_t& line_no);
  // Positions the reader so that the next line returned starts at byte `offset` and is numbered `line_no`.
  void seek(int64_t offset, int64_t line_no);
  const std::string& path() const { return path_; }

 private:
  bool fill();  // reads more decompressed bytes into buf_; false at end of file

  struct Stream;
  std::string path_;
  std::unique_ptr<Stream> stream_;
  std::string buf_;
  size_t pos_ = 0;          // next unread byte of buf_
  int64_t buf_offset_ = 0;  // file offset of buf_[0]
  int64_t line_no_ = 1;     // number of the line starting at pos_
  bool eof_ = false;
};

class TableReader;

// One pass over the documents of a list of files, in order.
class DocumentReader {
 public:
  // `text_field`: the JSON field, or the table column, holding the text.
  DocumentReader(std::vector<std::string> files, std::string text_field);
  ~DocumentReader();

  // The next document's text and position; false after the last line of the last file. The epoch of
  // returned positions is the one given to rewind()/seek() (0 at first).
  bool next(std::string& text, DocPos& pos);
  // The same in two halves, so that the text can be extracted on another thread: the next non-blank
  // line as read, and the text field of such a line (the errors of next(); safe to call concurrently).
  // A table file's row comes as its text already, which text_of returns unchanged.
  bool next_line(std::string& line, DocPos& pos);
  std::string text_of(const std::string& line, const DocPos& pos) const;
  // Starts the pass over from the first file, stamping positions with `epoch`.
  void rewind(int64_t epoch);
  // Continues at `pos` (a position that next() returned earlier, possibly in another process).
  void seek(const DocPos& pos);

  const std::vector<std::string>& files() const { return files_; }
  const std::string& text_field() const { return field_; }

 private:
  std::vector<std::string> files_;
  std::string field_;
  std::vector<char> table_;  // whether files_[i] is a table file (read with a TableReader)
  std::unique_ptr<LineReader> reader_;
  std::unique_ptr<TableReader> table_reader_;
  int64_t file_ = 0;
  int64_t epoch_ = 0;
  std::string line_;
};

}  // namespace titan::data
