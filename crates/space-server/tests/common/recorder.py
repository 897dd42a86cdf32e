# A server inside a sandbox that writes every request it gets (request
# line, every header as received, the body) to /tmp/seen.log; a WebSocket
# gets the first subprotocol offered and its text frames echoed. Listens on
# 127.0.0.1, on the port given as its argument. Used by the port proxy's
# tests (tests/ports.rs, tests/abuse/ports.rs).
import base64, hashlib, http.server, sys
class App(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def record(self, extra=b""):
        with open("/tmp/seen.log", "ab") as log:
            log.write(self.raw_requestline + str(self.headers).encode() + extra + b"\n----\n")
    def body(self):
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))
        data = b""
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            data += self.rfile.read(size)
            self.rfile.readline()
            if size == 0:
                return data
    def reply(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        data = self.body()
        self.record(b"body: " + data)
        self.reply(b"got " + data)
    def do_GET(self):
        self.record()
        if self.headers.get("Upgrade", "").lower() != "websocket":
            return self.reply(b"seen")
        key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        offered = [p.strip() for p in self.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
        if offered:
            self.send_header("Sec-WebSocket-Protocol", offered[0])
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            if len(head) < 2 or head[0] & 0x0f == 8:
                return
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(head[1] & 0x7f)))
            reply = b"echo: " + data
            self.wfile.write(bytes([0x81, len(reply)]) + reply)
            self.wfile.flush()
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), App).serve_forever()
