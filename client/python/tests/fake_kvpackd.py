#!/usr/bin/env python3
"""A stand-in for kvpackd used to test kvpack.testing.LocalDaemon without the real daemon: it
answers --help, serves a fixed /metrics page on --metrics_address and accepts connections on the
listen address (host:port, or unix:PATH). Exits on SIGTERM like the daemon."""

import http.server
import signal
import socket
import sys
import threading

PAGE = b"# TYPE kvpack_queue_depth gauge\nkvpack_queue_depth 0\n"


def main(argv):
    if "--help" in argv:
        print("  --address=ADDR   (a decoy: --listen wins)\n  --listen=ADDR   gRPC address\n"
              "  --metrics_address=ADDR")
        return 0
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if flags["listen"].startswith("unix:"):
        grpc = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        grpc.bind(flags["listen"][len("unix:"):])
        grpc.listen()
    else:
        host, port = flags["listen"].rsplit(":", 1)
        grpc = socket.create_server((host, int(port)))
    mhost, mport = flags["metrics_address"].rsplit(":", 1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer((mhost, int(mport)), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print("fake kvpackd serving", flush=True)
    server.serve_forever()
    grpc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
