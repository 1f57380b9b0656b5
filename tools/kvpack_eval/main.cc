// kvpack-eval: see eval.h.
#include <cstdio>
#include <string>
#include <vector>

#include "tools/kvpack_eval/eval.h"

int main(int argc, char** argv) {
  using namespace kvpack::tools;
  const std::vector<std::string> args(argv + 1, argv + argc);
  EvalOptions options;
  std::string error;
  if (!ParseEvalArgs(args, &options, &error)) {
    if (error.empty()) {  // --help
      std::fputs(kEvalUsage, stdout);
      return kExitOk;
    }
    std::fprintf(stderr, "kvpack-eval: %s\n%s", error.c_str(), kEvalUsage);
    return kExitUsage;
  }
  std::string json;
  const int code = RunEval(options, &json, &error);
  if (code != kExitOk) {
    std::fprintf(stderr, "kvpack-eval: %s\n", error.c_str());
    return code;
  }
  std::printf("%s\n", json.c_str());
  return kExitOk;
}
