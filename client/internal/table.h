#pragma once

// Table: a plain-text table with aligned columns, for kvpoolctl's human-readable output.
// Columns whose data cells are all numbers are right-aligned, the rest left-aligned.
//
// Not thread-safe (a value type).

#include <string>
#include <vector>

namespace kvpool::client::internal {

class Table final {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}

  // REQUIRES: row.size() == header size (missing cells print empty, extra cells are dropped).
  void AddRow(std::vector<std::string> row);
  size_t num_rows() const { return rows_.size(); }

  // The header and the rows, one line each, columns separated by two spaces, no trailing blanks.
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace kvpool::client::internal
