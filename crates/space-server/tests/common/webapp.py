# A small web app for preview tests, run inside a sandbox as
# `python3 webapp.py PORT`: a page with an absolute asset path, a cookie of
# its own and a WebSocket echo; what it was sent; big streaming bodies; a
# few server-sent events.
import base64, hashlib, http.server, json, sys, time

PAGE = b"""<!doctype html><html><head><title>preview app</title>
<script src="/static/app.js"></script></head>
<body><h1 id="title">preview app</h1><p id="ws">waiting</p><p id="seen"></p></body></html>"""

SCRIPT = b"""window.addEventListener('load', () => {
  const ws = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/ws');
  ws.onopen = () => ws.send('hello');
  ws.onmessage = (m) => { document.getElementById('ws').textContent = m.data; };
  ws.onerror = () => { document.getElementById('ws').textContent = 'ws error'; };
  fetch('/seen').then(r => r.json()).then(j => { document.getElementById('seen').textContent = j.cookie || ''; });
});"""


class App(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, body, kind="text/plain", extra=()):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            if len(head) < 2 or head[0] & 0x0F == 8:
                return
            length = head[1] & 0x7F
            if length == 126:
                length = int.from_bytes(self.rfile.read(2), "big")
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            reply = b"echo: " + data
            self.wfile.write(bytes([0x81, len(reply)]) + reply)
            self.wfile.flush()

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.websocket()
        if path == "/":
            return self.reply(PAGE, "text/html", [("Set-Cookie", "app_session=from-the-app; Path=/; SameSite=Lax")])
        if path == "/static/app.js":
            return self.reply(SCRIPT, "application/javascript")
        if path == "/big":
            mib = int(query.split("=")[1]) if query.startswith("mib=") else 1
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(mib << 20))
            self.end_headers()
            chunk = b"\0" * (1 << 20)
            for _ in range(mib):
                self.wfile.write(chunk)
            return
        if path == "/events":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for n in range(3):
                self.wfile.write(f"data: tick {n}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.2)
            self.close_connection = True
            return
        # Anything else: what the request looked like here.
        seen = {"method": "GET", "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                "cookie": self.headers.get("Cookie")}
        self.reply(json.dumps(seen).encode(), "application/json")

    def do_POST(self):
        left = int(self.headers.get("Content-Length", 0))
        digest = hashlib.sha256()
        while left:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
        self.reply(json.dumps({"sha256": digest.hexdigest()}).encode(), "application/json")


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), App).serve_forever()
