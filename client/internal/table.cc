#include "client/internal/table.h"

#include <algorithm>
#include <cctype>

namespace kvpool::client::internal {
namespace {

// Digits with an optional sign, decimal point, grouping or unit-less percent sign.
bool LooksNumeric(const std::string& cell) {
  if (cell.empty()) return true;  // an empty cell does not decide a column's alignment
  bool digit = false;
  for (char c : cell) {
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digit = true;
    } else if (c != '.' && c != '-' && c != '+' && c != '%' && c != ',') {
      return false;
    }
  }
  return digit;
}

}  // namespace

void Table::AddRow(std::vector<std::string> row) {
  row.resize(header_.size());
  rows_.push_back(std::move(row));
}

std::string Table::Render() const {
  const size_t columns = header_.size();
  std::vector<size_t> width(columns);
  std::vector<bool> right(columns, !rows_.empty());
  for (size_t c = 0; c < columns; ++c) {
    width[c] = header_[c].size();
    for (const auto& row : rows_) {
      width[c] = std::max(width[c], row[c].size());
      if (!LooksNumeric(row[c])) right[c] = false;
    }
  }
  std::string out;
  auto emit = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < columns; ++c) {
      if (c > 0) line += "  ";
      const std::string pad(width[c] - row[c].size(), ' ');
      line += right[c] ? pad + row[c] : row[c] + pad;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  };
  emit(header_);
  for (const auto& row : rows_) emit(row);
  return out;
}

}  // namespace kvpool::client::internal
