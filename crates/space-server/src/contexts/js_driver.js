// SPACE's code-context driver for JavaScript: runs in the sandbox under
// Node.js, keeps one V8 context alive (top-level declarations persist from
// run to run), and speaks the same JSON lines as the Python driver.
// Requests: {"op": "run", "id", "code", "timeout_s", "env"}, {"op": "restart"}; an
// interrupt is SIGINT (a run in progress blocks this thread).
"use strict";
const vm = require("vm");
const util = require("util");
const readline = require("readline");

let current = null;
let count = 0;

function emit(event) {
  process.stdout.write(JSON.stringify(event) + "\n");
}

function text(args) {
  return util.format(...args) + "\n";
}

function fresh() {
  const out = (kind) => (...args) => {
    if (current) emit({ run: current, type: kind, text: text(args) });
  };
  const console = { log: out("stdout"), info: out("stdout"), debug: out("stdout"), warn: out("stderr"), error: out("stderr") };
  const sandbox = { console, require, process, Buffer, URL, setTimeout, clearTimeout, setInterval, clearInterval };
  count = 0;
  return vm.createContext(sandbox);
}

let context = fresh();

function run(request) {
  current = request.id;
  let status = "ok";
  const env = request.env || {};
  const saved = Object.fromEntries(Object.keys(env).map((name) => [name, process.env[name]]));
  Object.assign(process.env, env);
  try {
    const script = new vm.Script(request.code, { filename: "cell.js" });
    const options = { breakOnSigint: true };
    if (request.timeout_s) options.timeout = request.timeout_s * 1000;
    const value = script.runInContext(context, options);
    if (value !== undefined) {
      const data = { "text/plain": util.inspect(value) };
      if (value !== null && typeof value === "object") {
        try {
          data["application/json"] = JSON.parse(JSON.stringify(value));
        } catch (_) {}
      }
      emit({ run: current, type: "result", data, is_main_result: true });
    }
  } catch (e) {
    const code = e && e.code;
    status = code === "ERR_SCRIPT_EXECUTION_TIMEOUT" ? "timeout" : "error";
    const name = code === "ERR_SCRIPT_EXECUTION_INTERRUPTED" ? "KeyboardInterrupt" : (e && e.name) || "Error";
    const value = (e && e.message) || String(e);
    const traceback = String((e && e.stack) || value).split("\n");
    emit({ run: current, type: "error", name, value, traceback });
  }
  for (const [name, value] of Object.entries(saved)) {
    if (value === undefined) delete process.env[name];
    else process.env[name] = value;
  }
  count += 1;
  emit({ run: current, type: "end", status, execution_count: count });
  current = null;
}

const lines = readline.createInterface({ input: process.stdin });
lines.on("line", (line) => {
  let request;
  try {
    request = JSON.parse(line);
  } catch (_) {
    return;
  }
  if (request.op === "run") run(request);
  else if (request.op === "restart") {
    context = fresh();
    emit({ type: "ready", restarted: true });
  }
});
lines.on("close", () => process.exit(0));
process.on("SIGINT", () => {}); // only a run in progress is interrupted
emit({ type: "ready", cwd: process.cwd() });
