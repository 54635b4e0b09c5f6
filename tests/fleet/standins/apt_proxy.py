"""HTTP forward proxy for the simulated hosts' apt. Not a stand-in - it imitates nothing: the
hosts get Debian's real packages from this machine's configured Debian mirror through it, since
they can only reach the bridge (README, Testing: "Not a stand-in").

The hosts' apt is configured with Acquire::http::Proxy "http://10.213.0.1:3142". The proxy only
forwards GET/HEAD for the hosts named in the machine's own apt sources (the Debian mirror); any
other destination gets 403. .deb files (immutable by name) are cached under the cache dir so
repeated bring-ups do not download them again; index files are passed through.

Usage: python3 -m tests.fleet.standins.apt_proxy --bind ADDR --port 3142 --cache DIR
       --allow HOST [--allow HOST ...]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import shutil
import sys
import tempfile
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.fleet.standins import send_text

HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    allowed: set[str] = set()
    cache_dir = "."

    def log_message(self, fmt, *args):
        sys.stderr.write("apt-proxy: " + (fmt % args) + "\n")

    def do_HEAD(self):
        self.proxy(head=True)

    def do_GET(self):
        self.proxy(head=False)

    def _error(self, code: int, text: str) -> None:
        send_text(self, code, text)

    def proxy(self, head):
        url = urllib.parse.urlsplit(self.path)
        if url.scheme != "http" or url.hostname not in self.allowed:
            return self._error(403, f"apt-proxy: destination not allowed: {self.path}")
        cacheable = url.path.endswith(".deb") and not head
        cache_file = None
        if cacheable:
            key = hashlib.sha256(self.path.encode()).hexdigest()[:16]
            cache_file = os.path.join(self.cache_dir, key + "_" + os.path.basename(url.path))
            if os.path.exists(cache_file):
                size = os.path.getsize(cache_file)
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.debian.binary-package")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                with open(cache_file, "rb") as f:
                    shutil.copyfileobj(f, self.wfile)
                return
        conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        headers["Host"] = url.netloc
        path = url.path + (("?" + url.query) if url.query else "")
        try:
            conn.request("HEAD" if head else "GET", path, headers=headers)
            resp = conn.getresponse()
        except OSError as e:
            return self._error(502, f"apt-proxy: upstream failed: {e}")
        self.send_response(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        for k, v in resp.getheaders():
            if k.lower() not in HOP_HEADERS and k.lower() != "content-length":
                self.send_header(k, v)
        chunked = length is None and not head
        if length is not None:
            self.send_header("Content-Length", length)
        elif chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if head:
            conn.close()
            return
        tmp = None
        if cacheable and resp.status == 200:
            tmp = tempfile.NamedTemporaryFile(dir=self.cache_dir, delete=False)
        try:
            while True:
                chunk = resp.read(65536)
                if not chunk:
                    break
                if tmp:
                    tmp.write(chunk)
                if chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                else:
                    self.wfile.write(chunk)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
            if tmp:
                tmp.close()
                os.replace(tmp.name, cache_file)
                tmp = None
        finally:
            if tmp:
                tmp.close()
                os.unlink(tmp.name)
            conn.close()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--port", type=int, default=3142)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--allow", action="append", default=[])
    a = ap.parse_args(argv)
    os.makedirs(a.cache, exist_ok=True)
    Handler.allowed = set(a.allow)
    Handler.cache_dir = a.cache
    server = ThreadingHTTPServer((a.bind, a.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
