// A small command-line parser shared by the distmuon-* tools: --key value and --flag options,
// each declared with its default and help line, with clear errors for unknown or bad options.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace distmuon::cli {

class Args {
 public:
  Args(std::string program, std::string summary);
  // Declares an option taking a value, or a flag when is_flag.
  void option(const std::string& name, const std::string& default_value, const std::string& help,
              bool is_flag = false);
  // Parses argv; prints help and returns false for --help. Throws distmuon::Error on bad input.
  bool parse(int argc, char** argv);

  std::string str(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  double number(const std::string& name) const;
  bool flag(const std::string& name) const;
  bool given(const std::string& name) const;  // set on the command line
  std::vector<std::string> list(const std::string& name) const;  // comma separated
  std::vector<double> numbers(const std::string& name) const;

  std::string help() const;

 private:
  struct Opt {
    std::string default_value, help, value;
    bool is_flag = false, given = false;
  };
  std::string program_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Opt> opts_;
  const Opt& get(const std::string& name) const;
};

// Median, min and max of a list of timings.
struct Summary {
  double median = 0, min = 0, max = 0;
};
Summary summarize(std::vector<double> v);
// Shortest decimal form of a number ("2", "0.5", "1e-06").
std::string format_number(double v);

}  // namespace distmuon::cli
