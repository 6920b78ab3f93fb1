// The cost file's JSON, for the measurement store (src/measure/store.h), which keeps its own
// sections beside the tables in the same file: {"format": "distmuon-cost-table",
// "format_version": 1, "tables": [...], ...}. Readers ignore members they do not know.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "distmuon/cost_table.h"

namespace distmuon {

nlohmann::json cost_tables_to_json(const std::vector<CostTable>& tables);
// Parses a cost file's text and checks its format and version; throws naming `origin`.
nlohmann::json parse_cost_json(const std::string& text, const std::string& origin);
// The tables of a parsed cost file; throws naming `origin` on a missing or mistyped field.
std::vector<CostTable> cost_tables_from_json(const nlohmann::json& file, const std::string& origin);
std::string read_text_file(const std::string& path);  // throws naming the path

}  // namespace distmuon
