// SPACE's code-context driver for JavaScript: runs in the sandbox under
// Node.js, keeps one V8 context alive (top-level declarations persist from
// run to run), and speaks the same JSON lines as the Python driver.
// Requests: {"op": "run", "id", "code", "timeout_s", "env"}, {"op": "restart"}; an
// interrupt is SIGINT (a run in progress blocks this thread).
// Node takes SIGINT away from its listeners while `runInContext` sets up
// and tears down its watch for it (`breakOnSigint`): a SIGINT then kills
// the process. So a run first says `started` from inside the run, where
// the watch is on, and the host signals only between that and the end;
// an interrupt asked earlier waits for it.
"use strict";
const fs = require("fs");
const vm = require("vm");
const util = require("util");
const readline = require("readline");

let current = null;
let count = 0;

// Events are written straight to descriptor 1, whole and at once: a run's
// `started` must be out before its code goes on (and a SIGINT that comes
// after a `process.stdout.write` of it was seen to be lost), and the
// leading newline ends any line the code wrote there itself.
const PAUSE = new Int32Array(new SharedArrayBuffer(4));
function emit(event) {
  let data = Buffer.from("\n" + JSON.stringify(event) + "\n");
  while (data.length > 0) {
    try {
      data = data.subarray(fs.writeSync(1, data));
    } catch (e) {
      // Descriptor 1 is non-blocking once code used `process.stdout`.
      if (e.code !== "EAGAIN") throw e;
      Atomics.wait(PAUSE, 0, 0, 1);
    }
  }
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
  // What a run calls first (fixed: code cannot delete or replace it).
  Object.defineProperty(sandbox, STARTED, {
    value: () => emit({ run: current, type: "started" }),
    enumerable: false,
    writable: false,
    configurable: false,
  });
  count = 0;
  return vm.createContext(sandbox);
}

const STARTED = "__space_started";
// A leading "use strict" stays the first statement of what runs.
const STRICT = /^(?:\s|\/\/[^\n]*\n|\/\*[\s\S]*?\*\/)*(['"])use strict\1/;

const PRELUDE_SHOWN = /^cell\.js:0\n(?:"use strict"; )?__space_started\(\);\n\^*\n\n?/;

// The code with the call that says it started on a line before it (the
// line numbers of its errors stay its own).
function prelude(code) {
  return (STRICT.test(code) ? '"use strict"; ' : "") + STARTED + "();\n" + code;
}

let context = fresh();

function run(request) {
  current = request.id;
  let status = "ok";
  const env = request.env || {};
  const saved = Object.fromEntries(Object.keys(env).map((name) => [name, process.env[name]]));
  Object.assign(process.env, env);
  try {
    const script = new vm.Script(prelude(request.code), { filename: "cell.js", lineOffset: -1 });
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
    status =
      code === "ERR_SCRIPT_EXECUTION_TIMEOUT" ? "timeout" : code === "ERR_SCRIPT_EXECUTION_INTERRUPTED" ? "interrupted" : "error";
    const name = code === "ERR_SCRIPT_EXECUTION_INTERRUPTED" ? "KeyboardInterrupt" : (e && e.name) || "Error";
    const value = (e && e.message) || String(e);
    // An error before the run's first statement points at the prelude.
    const stack = String((e && e.stack) || value).replace(PRELUDE_SHOWN, "");
    const traceback = stack.split("\n");
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
