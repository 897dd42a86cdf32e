// SPACE's code-context driver for JavaScript and TypeScript: runs in the
// sandbox under Node.js, keeps one V8 context alive (top-level declarations
// persist from run to run), and speaks the same JSON lines as the Python
// driver. Requests: {"op": "run", "id", "code", "timeout_s", "env"},
// {"op": "restart"}; an interrupt is SIGINT (a run in progress blocks this
// thread). Its one argument is the language: `typescript` cells are
// transpiled first (Debian's `node-typescript`, when installed).
// A cell may use ES module `import` declarations (each becomes a
// `require`, its names `var`s of the context) and top-level `await` (Node's
// own REPL rewrite, reached with --expose-internals: the cell runs as an
// async function whose declarations are hoisted to the context, and the run
// ends when its promise settles).
// Node takes SIGINT away from its listeners while `runInContext` sets up
// and tears down its watch for it (`breakOnSigint`): a SIGINT then kills
// the process. So a run first says `started` from inside the run, where
// the watch is on, and the host signals only between that and the end;
// an interrupt asked earlier waits for it. A run awaiting a promise is
// ended by the SIGINT itself (what it awaited is left to settle unseen).
"use strict";
const fs = require("fs");
const vm = require("vm");
const util = require("util");
const readline = require("readline");

const LANGUAGE = process.argv.slice(1).includes("typescript") ? "typescript" : "javascript";
function internal(name) {
  try {
    return require(name);
  } catch (_) {
    return null;
  }
}
const acorn = internal("internal/deps/acorn/acorn/dist/acorn");
const replAwait = internal("internal/repl/await");
let typescript;

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

// `code` with its `import` and `export` declarations made into a
// script's: `import x, {a as b} from "m"` → `var __m = require("m"), x =
// ..., b = __m.a` on as many lines. Code acorn cannot parse is left as it
// is (the run shows the error).
function withoutModules(code) {
  if (!acorn || !/\b(?:import|export)\b/.test(code)) return code;
  let program;
  try {
    program = acorn.parse(code, { ecmaVersion: "latest", sourceType: "module", allowAwaitOutsideFunction: true });
  } catch (_) {
    return code;
  }
  let out = "";
  let at = 0;
  let n = 0;
  for (const node of program.body) {
    const lines = "\n".repeat((code.slice(node.start, node.end).match(/\n/g) || []).length);
    if (node.type === "ImportDeclaration") {
      const module = `__space_module_${n++}`;
      const names = [`${module} = require(${JSON.stringify(node.source.value)})`];
      for (const spec of node.specifiers) {
        const local = spec.local.name;
        if (spec.type === "ImportDefaultSpecifier") {
          names.push(`${local} = ${module} && ${module}.__esModule ? ${module}.default : ${module}`);
        } else if (spec.type === "ImportNamespaceSpecifier") {
          names.push(`${local} = ${module}`);
        } else {
          const imported = spec.imported.name !== undefined ? spec.imported.name : spec.imported.value;
          names.push(`${local} = ${module}[${JSON.stringify(imported)}]`);
        }
      }
      out += code.slice(at, node.start) + `var ${names.join(", ")};` + lines;
      at = node.end;
    } else if ((node.type === "ExportNamedDeclaration" || node.type === "ExportDefaultDeclaration") && node.declaration) {
      out += code.slice(at, node.start);
      at = node.declaration.start;
    } else if (node.type === "ExportNamedDeclaration" || node.type === "ExportAllDeclaration") {
      out += code.slice(at, node.start) + lines;
      at = node.end;
    }
  }
  return out + code.slice(at);
}

// A TypeScript cell as JavaScript (types erased, modules kept for
// `withoutModules`).
function transpiled(code) {
  // Debian's package is found through Node's global paths, which follow
  // where `node` was started from (`/bin/node` gives `/share/nodejs`).
  if (typescript === undefined) typescript = internal("typescript") || internal("/usr/share/nodejs/typescript");
  if (!typescript) {
    throw new Error("TypeScript cells need the `typescript` package in the sandbox (Debian's node-typescript)");
  }
  const output = typescript.transpileModule(code, {
    compilerOptions: {
      target: typescript.ScriptTarget.ES2022,
      module: typescript.ModuleKind.ESNext,
      removeComments: false,
    },
    reportDiagnostics: false,
  });
  return output.outputText.replace(/\n?\/\/# sourceMappingURL=.*\s*$/, "");
}

function inspected(value) {
  const data = { "text/plain": util.inspect(value) };
  if (value !== null && typeof value === "object") {
    try {
      data["application/json"] = JSON.parse(JSON.stringify(value));
    } catch (_) {}
  }
  return data;
}

function failure(e) {
  const code = e && e.code;
  const status =
    code === "ERR_SCRIPT_EXECUTION_TIMEOUT" ? "timeout" : code === "ERR_SCRIPT_EXECUTION_INTERRUPTED" ? "interrupted" : "error";
  const name = code === "ERR_SCRIPT_EXECUTION_INTERRUPTED" ? "KeyboardInterrupt" : (e && e.name) || "Error";
  const value = (e && e.message) || String(e);
  // An error before the run's first statement points at the prelude.
  const stack = String((e && e.stack) || value).replace(PRELUDE_SHOWN, "");
  emit({ run: current, type: "error", name, value, traceback: stack.split("\n") });
  return status;
}

// The run awaiting its cell's promise: how to end it from outside (SIGINT,
// its timeout).
let waiting = null;
const queued = [];

function run(request) {
  current = request.id;
  const env = request.env || {};
  const saved = Object.fromEntries(Object.keys(env).map((name) => [name, process.env[name]]));
  Object.assign(process.env, env);
  const end = (status) => {
    for (const [name, value] of Object.entries(saved)) {
      if (value === undefined) delete process.env[name];
      else process.env[name] = value;
    }
    count += 1;
    emit({ run: current, type: "end", status, execution_count: count });
    current = null;
    waiting = null;
    setImmediate(next);
  };
  let promised = false;
  let value;
  try {
    let code = LANGUAGE === "typescript" ? transpiled(request.code) : request.code;
    code = prelude(withoutModules(code));
    if (replAwait && /\bawait\b/.test(code)) {
      try {
        const rewritten = replAwait.processTopLevelAwait(code);
        if (rewritten !== null) {
          code = rewritten;
          promised = true;
        }
      } catch (_) {
        // Not valid as an async body either: the script shows the error.
      }
    }
    const script = new vm.Script(code, { filename: "cell.js", lineOffset: -1 });
    const options = { breakOnSigint: true };
    if (request.timeout_s) options.timeout = request.timeout_s * 1000;
    value = script.runInContext(context, options);
  } catch (e) {
    return end(failure(e));
  }
  if (!promised) {
    if (value !== undefined) emit({ run: current, type: "result", data: inspected(value), is_main_result: true });
    return end("ok");
  }
  // The rewritten cell resolves to `{value}` (no `value` key: no last
  // expression).
  let settled = false;
  const once = (f) => (...args) => {
    if (!settled) {
      settled = true;
      clearTimeout(timer);
      f(...args);
    }
  };
  const timer = request.timeout_s
    ? setTimeout(() => waiting.stop("timeout"), request.timeout_s * 1000)
    : null;
  waiting = {
    stop: once((status) => {
      if (status !== "died")
        emit({
        run: current,
        type: "error",
        name: status === "timeout" ? "TimeoutError" : "KeyboardInterrupt",
        value: status === "timeout" ? "the run did not end in time" : "interrupted",
        traceback: [],
      });
      end(status);
    }),
  };
  Promise.resolve(value).then(
    once((result) => {
      if (result && typeof result === "object" && "value" in result && result.value !== undefined) {
        emit({ run: current, type: "result", data: inspected(result.value), is_main_result: true });
      }
      end("ok");
    }),
    once((e) => end(failure(e)))
  );
}

function next() {
  while (current === null && queued.length > 0) {
    const request = queued.shift();
    if (request.op === "run") run(request);
    else {
      context = fresh();
      emit({ type: "ready", restarted: true });
    }
  }
}

const lines = readline.createInterface({ input: process.stdin });
lines.on("line", (line) => {
  let request;
  try {
    request = JSON.parse(line);
  } catch (_) {
    return;
  }
  // A restart does not wait for a run awaiting a promise: it cuts it.
  if (request.op === "restart" && waiting) waiting.stop("died");
  if (request.op === "run" || request.op === "restart") {
    queued.push(request);
    next();
  }
});
lines.on("close", () => process.exit(0));
// Only a run in progress is interrupted: one running its code synchronously
// by `breakOnSigint`, one awaiting here.
process.on("SIGINT", () => {
  if (waiting) waiting.stop("interrupted");
});
emit({ type: "ready", cwd: process.cwd() });
