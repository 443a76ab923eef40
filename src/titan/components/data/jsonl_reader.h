// Streaming reader of c4-style text data: JSON Lines files (one JSON object per line) holding the
// document text in one string field, optionally compressed with gzip (.gz) or zstd (.zst).
//
// Files are read in chunks, never whole. Compression is recognized by the file's magic bytes, so the
// extension only matters for which files of a folder are listed (see list_data_files). A line that is
// not a JSON object, or lacks the text field, is a user error naming file and line: titan stops rather
// than silently training on less data. Blank lines are skipped.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace titan::data {

// The data files of `path`: the file itself, or the files of a folder (recursively) whose names end in
// .json / .jsonl, optionally followed by .gz or .zst, sorted by their path relative to `path`.
// A clone of the Hugging Face allenai/c4 repository (a folder with en/c4-train.*.json.gz) is narrowed
// to en/c4-<split>.*: pass split = "train" or "validation" for that; other folders ignore `split`.
// Throws UserError when the path does not exist or a folder holds no data file.
std::vector<std::string> list_data_files(const std::string& path, const std::string& split = "train");

// Where a document starts: which pass over the files (epoch), which file, the byte offset of its line
// in the decompressed file, and that line's 1-based number (for error messages after a resume).
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

// One pass over the documents of a list of files, in order.
class JsonlReader {
 public:
  JsonlReader(std::vector<std::string> files, std::string text_field);

  // The next document's text and position; false after the last line of the last file. The epoch of
  // returned positions is the one given to rewind()/seek() (0 at first).
  bool next(std::string& text, DocPos& pos);
  // The same in two halves, so that the text can be extracted on another thread: the next non-blank
  // line as read, and the text field of such a line (the errors of next(); safe to call concurrently).
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
  std::unique_ptr<LineReader> reader_;
  int64_t file_ = 0;
  int64_t epoch_ = 0;
  std::string line_;
};

}  // namespace titan::data
