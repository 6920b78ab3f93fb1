#include "cli.h"

#include <algorithm>
#include <iostream>
#include <sstream>

#include "distmuon/error.h"

namespace distmuon::cli {

Args::Args(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {
  option("help", "0", "print this help", true);
}

void Args::option(const std::string& name, const std::string& def, const std::string& help,
                  bool is_flag) {
  order_.push_back(name);
  opts_[name] = Opt{def, help, def, is_flag, false};
}

bool Args::parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    DM_CHECK(a.rfind("--", 0) == 0, "unexpected argument '", a, "' (options start with --; see --help)");
    std::string key = a.substr(2), value;
    bool inline_value = false;
    if (auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
      inline_value = true;
    }
    auto it = opts_.find(key);
    DM_CHECK(it != opts_.end(), "unknown option --", key, " (see --help)");
    Opt& o = it->second;
    if (o.is_flag) {
      o.value = inline_value ? value : "1";
    } else if (inline_value) {
      o.value = value;
    } else {
      DM_CHECK(i + 1 < argc, "option --", key, " needs a value");
      o.value = argv[++i];
    }
    o.given = true;
  }
  if (flag("help")) {
    std::cout << help();
    return false;
  }
  return true;
}

const Args::Opt& Args::get(const std::string& name) const {
  auto it = opts_.find(name);
  DM_CHECK(it != opts_.end(), "internal: option --", name, " was not declared");
  return it->second;
}

std::string Args::str(const std::string& name) const { return get(name).value; }

int64_t Args::integer(const std::string& name) const {
  const std::string& v = get(name).value;
  try {
    size_t used = 0;
    int64_t r = std::stoll(v, &used);
    if (used == v.size()) return r;
  } catch (const std::exception&) {
  }
  DM_FAIL("--", name, " expects an integer, got '", v, "'");
}

double Args::number(const std::string& name) const {
  const std::string& v = get(name).value;
  try {
    size_t used = 0;
    double r = std::stod(v, &used);
    if (used == v.size()) return r;
  } catch (const std::exception&) {
  }
  DM_FAIL("--", name, " expects a number, got '", v, "'");
}

bool Args::flag(const std::string& name) const {
  const std::string& v = get(name).value;
  return v == "1" || v == "true" || v == "yes";
}

bool Args::given(const std::string& name) const { return get(name).given; }

std::vector<std::string> Args::list(const std::string& name) const {
  std::vector<std::string> out;
  std::stringstream ss(get(name).value);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<double> Args::numbers(const std::string& name) const {
  std::vector<double> out;
  for (const auto& s : list(name)) {
    try {
      size_t used = 0;
      double r = std::stod(s, &used);
      DM_CHECK(used == s.size(), "");
      out.push_back(r);
    } catch (const std::exception&) {
      DM_FAIL("--", name, " expects numbers, got '", s, "'");
    }
  }
  return out;
}

std::string Args::help() const {
  std::ostringstream os;
  os << "usage: " << program_ << " [options]\n" << summary_ << "\n\noptions:\n";
  for (const auto& name : order_) {
    const Opt& o = opts_.at(name);
    std::string left = "  --" + name + (o.is_flag ? "" : " VALUE");
    os << left << std::string(left.size() < 28 ? 28 - left.size() : 1, ' ') << o.help;
    if (!o.is_flag && !o.default_value.empty()) os << " (default: " << o.default_value << ")";
    os << "\n";
  }
  return os.str();
}

Summary summarize(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  double med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return {med, v.front(), v.back()};
}

std::string format_number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace distmuon::cli
