// A minimal HTTP/1.1 endpoint for Prometheus scrapes: GET /metrics answers `render()` as
// text/plain; version=0.0.4, anything else 404, one request per connection.
//
// Why not prometheus-cpp's Exposer: it runs civetweb, whose threads are created with a fixed 100 KiB
// stack. cuBLASLt, linked into the CUDA build, carries ~94 KiB of static TLS, which glibc places on
// every thread's stack, so civetweb's pthread_create fails with EINVAL in kvpackd. This server runs
// one thread with the default stack and needs nothing beyond POSIX sockets.
//
// Thread safety: render() is called on the server's thread; it must be thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace kvpack::server {

class MetricsHttpServer {
 public:
  // Listens on `address` ("host:port"; port 0 picks one; host an IPv4 address or "localhost").
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                   std::function<std::string()> render);
  ~MetricsHttpServer();  // stops accepting and joins the thread

  int port() const { return port_; }

 private:
  MetricsHttpServer(int listen_fd, int wake_fd_read, int wake_fd_write, int port,
                    std::function<std::string()> render);
  void Loop();
  void Answer(int fd);

  const int listen_fd_;
  const int wake_read_;
  const int wake_write_;
  const int port_;
  const std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace kvpack::server
