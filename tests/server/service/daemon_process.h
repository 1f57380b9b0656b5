// Test helper: starts the REAL kvpackd binary on loopback with ephemeral ports, waits for its
// "listening on … (port P), metrics port M" line, and stops it with SIGTERM (checking that it
// drains and exits 0). Also a minimal HTTP GET for /metrics.
#pragma once

#include <algorithm>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/server/service/metrics_text.h"
#include "tests/server/service/sanitizer_build.h"
#include "client/client.h"

#ifndef KVPACKD_PATH
#error "KVPACKD_PATH must name the kvpackd binary"
#endif

namespace kvpack::testing {

class DaemonProcess {
 public:
  // Extra flags are appended to --listen=127.0.0.1:0 --metrics_address=127.0.0.1:0 --cpu_threads=1
  // (and --drain_seconds=30, ×kSanitizerSlowdown, unless they give one).
  // `address_space` > 0 caps the daemon's virtual memory (RLIMIT_AS), so large allocations fail.
  explicit DaemonProcess(std::vector<std::string> flags, uint64_t address_space = 0) {
    int out[2];
    if (pipe(out) != 0) return;
    // $KVPACKD overrides the build-time path (a bundle copied to a GPU host).
    binary_ = getenv("KVPACKD") != nullptr ? getenv("KVPACKD") : KVPACKD_PATH;
    pid_ = fork();
    if (pid_ == 0) {
      if (address_space > 0) {
        const rlimit limit{address_space, address_space};
        setrlimit(RLIMIT_AS, &limit);
      }
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      std::vector<std::string> args = {binary_, "--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                                       "--cpu_threads=1"};
      // A sanitizer build runs layers ~10x slower: in-flight work gets as much longer to drain.
      const bool drain_given = std::any_of(flags.begin(), flags.end(),
                                           [](const std::string& f) { return f.rfind("--drain_seconds", 0) == 0; });
      if (!drain_given) args.push_back("--drain_seconds=" + std::to_string(30 * kSanitizerSlowdown));
      args.insert(args.end(), flags.begin(), flags.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    std::string line;
    char c;
    while (read(out[0], &c, 1) == 1 && c != '\n') line += c;
    close(out[0]);
    std::smatch m;
    if (std::regex_search(line, m, std::regex(R"(\(port (\d+)\), metrics port (\d+))"))) {
      port_ = std::stoi(m[1]);
      metrics_port_ = std::stoi(m[2]);
    }
    first_line_ = line;
  }

  ~DaemonProcess() {
    if (pid_ > 0 && !stopped_) Stop();
  }

  bool ok() const { return port_ > 0; }
  // Why ok() is false, for a test's failure message: the binary tried and the daemon's first line.
  std::string why() const {
    return "kvpackd did not start: " + binary_ + " printed \"" + first_line_ +
           "\" (on a host without the build tree, set $KVPACKD to a kvpackd binary)";
  }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  std::unique_ptr<client::Client> Connect(const std::string& tenant = "", const std::string& token = "",
                                          absl::Duration timeout = absl::Seconds(60)) const {
    client::ClientOptions o;
    o.address = address();
    o.tenant = tenant;
    o.token = token;
    o.timeout = timeout;
    return std::move(*client::Client::Connect(o));
  }

  // SIGTERM, then wait; returns the exit status (0 after a clean drain).
  int Stop() {
    stopped_ = true;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  std::string Metrics() const { return HttpGet(metrics_port_, "/metrics"); }

  static std::string HttpGet(int port, const std::string& path) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      return "";
    }
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, req.data(), req.size()) < 0) return "";
    std::string body;
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) body.append(buf, static_cast<size_t>(n));
    close(fd);
    return body;
  }

 private:
  pid_t pid_ = -1;
  std::string binary_, first_line_;
  int port_ = 0;
  int metrics_port_ = 0;
  bool stopped_ = false;
};

}  // namespace kvpack::testing
