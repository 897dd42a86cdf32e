// The unmodified npm `e2b` and `@e2b/code-interpreter` packages against
// SPACE, configured with E2B's environment variables only (E2B_API_URL,
// E2B_SANDBOX_URL, E2B_API_KEY), run by Node.js as a user would: a
// sandbox's commands and files, then code runs with results, contexts,
// per-run env, modules and await, a chart's data and a timeout. Prints
// "NPM SDK OK" last; any failure throws (a non-zero exit).
import assert from "node:assert/strict";
import { Sandbox } from "e2b";
import { Sandbox as CodeInterpreter } from "@e2b/code-interpreter";

const base = await Sandbox.create({ metadata: { suite: "npm" } });
try {
  const ran = await base.commands.run("echo from-node && id -u");
  assert.equal(ran.exitCode, 0);
  assert.match(ran.stdout, /^from-node\n\d+\n$/);
  await base.files.write("/tmp/npm.txt", "written by the npm SDK");
  assert.equal(await base.files.read("/tmp/npm.txt"), "written by the npm SDK");
  const listed = await Sandbox.list({ query: { metadata: { suite: "npm" } } }).nextItems();
  assert.ok(listed.some((s) => s.sandboxId === base.sandboxId), JSON.stringify(listed));
  await assert.rejects(base.commands.run("exit 3"), (e) => e.exitCode === 3);
} finally {
  await base.kill();
}

const sbx = await CodeInterpreter.create({ metadata: { suite: "npm" } });
try {
  await sbx.runCode("x = 41");
  const answer = await sbx.runCode("x + 1");
  assert.equal(answer.text, "42");
  assert.equal((await sbx.runCode("'quoted'")).text, "quoted");
  const out = [];
  const printed = await sbx.runCode("print('hello')", { onStdout: (m) => out.push(m.line) });
  assert.deepEqual(printed.logs.stdout, ["hello\n"]);
  assert.deepEqual(out, ["hello\n"]);
  const failed = await sbx.runCode("1 / 0");
  assert.equal(failed.error.name, "ZeroDivisionError");
  const env = await sbx.runCode("echo $WHO", { language: "bash", envs: { WHO: "npm" } });
  assert.deepEqual(env.logs.stdout, ["npm\n"]);
  const js = await sbx.runCode("import { cpus } from 'os'\nawait Promise.resolve(typeof cpus)", { language: "js" });
  assert.equal(js.text, "function");
  const frame = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})");
  assert.deepEqual(frame.results[0].data, { a: [1, 2] });
  const chart = await sbx.runCode("import matplotlib.pyplot as plt\nplt.bar(['p', 'q'], [1, 2])\nplt.title('Bars')\nplt.show()");
  assert.ok(chart.results[0].png);
  assert.equal(chart.results[0].chart.type, "bar");
  assert.equal(chart.results[0].chart.title, "Bars");
  const ctx = await sbx.createCodeContext({ cwd: "/tmp", language: "python" });
  assert.equal((await sbx.runCode("import os; os.getcwd()", { context: ctx })).text, "/tmp");
  const contexts = await sbx.listCodeContexts();
  for (const language of ["python", "javascript"]) {
    assert.ok(contexts.some((c) => c.language === language), JSON.stringify(contexts));
  }
  await sbx.removeCodeContext(ctx.id);
  await assert.rejects(sbx.runCode("import time; time.sleep(60)", { timeoutMs: 1500 }));
} finally {
  await sbx.kill();
}
console.log("NPM SDK OK");
