#include "server/runtime/metrics_http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvpack::server {
namespace {

constexpr int kRequestTimeoutMs = 2000;    // a scraper that sends nothing is dropped after this
constexpr size_t kMaxRequestBytes = 8192;  // request line and headers

void WriteAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    sent += static_cast<size_t>(n);
  }
}

std::string Response(const char* status, const char* type, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& address,
                                                                            std::function<std::string()> render) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_address=", address, ": expected host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  if (host.empty()) host = "0.0.0.0";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_address=", address, ": host must be an IPv4 address"));
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("metrics socket: ", std::strerror(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("--metrics_address=", address, ": ", why));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::UnavailableError("metrics: pipe2 failed");
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(fd, wake[0], wake[1], ntohs(addr.sin_port), std::move(render)));
}

MetricsHttpServer::MetricsHttpServer(int listen_fd, int wake_fd_read, int wake_fd_write, int port,
                                     std::function<std::string()> render)
    : listen_fd_(listen_fd), wake_read_(wake_fd_read), wake_write_(wake_fd_write), port_(port),
      render_(std::move(render)) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  const char byte = 1;
  (void)!::write(wake_write_, &byte, 1);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_read_);
  ::close(wake_write_);
}

void MetricsHttpServer::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      const int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      Answer(conn);
      ::close(conn);
    }
  }
}

void MetricsHttpServer::Answer(int fd) {
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, kRequestTimeoutMs) <= 0) return;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const size_t line_end = request.find("\r\n");
  const std::string line = request.substr(0, line_end);
  const bool get = line.rfind("GET ", 0) == 0;
  const size_t path_end = line.find(' ', 4);
  const std::string path = get ? line.substr(4, path_end == std::string::npos ? std::string::npos : path_end - 4) : "";
  if (get && (path == "/metrics" || path.rfind("/metrics?", 0) == 0)) {
    WriteAll(fd, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_()));
  } else {
    WriteAll(fd, Response("404 Not Found", "text/plain", "kvpackd serves /metrics only\n"));
  }
}

}  // namespace kvpack::server
