//! `space mcp`: a Model Context Protocol server over stdio (JSON-RPC 2.0,
//! one message per line) whose tools drive a SPACE server through its API
//! (`SPACE_URL`, `SPACE_API_KEY`). A failing call is a tool result with
//! `isError: true` and the server's error message, never a crash.

use std::io::{BufRead, Write};

use anyhow::Result;
use serde_json::{json, Value};

use crate::client::{encode, Client};

/// The protocol revision this server speaks.
const PROTOCOL_VERSION: &str = "2024-11-05";

fn tools() -> Value {
    let id = json!({"type": "string", "description": "The sandbox id (sbx_…)"});
    let env = json!({"type": "object", "additionalProperties": {"type": "string"}});
    let volume = json!({"type": "string", "description": "Volume name: a-z, 0-9, - and _"});
    let only_id = json!({"type": "object", "properties": {"sandbox_id": id}, "required": ["sandbox_id"], "additionalProperties": false});
    let checkpoint = json!({"type": "object", "properties": {
            "sandbox_id": id, "name": {"type": "string", "description": "Checkpoint name: a-z, 0-9, - and _"}},
        "required": ["sandbox_id", "name"], "additionalProperties": false});
    json!([
        {"name": "create_sandbox",
         "description": "Create an isolated Linux sandbox and wait until it runs. Returns the sandbox.",
         "inputSchema": {"type": "object", "properties": {
             "template": {"type": "string", "description": "Template name (default: base)"},
             "env": env, "vcpus": {"type": "integer", "minimum": 1},
             "memory_mib": {"type": "integer", "minimum": 64}, "disk_mib": {"type": "integer", "minimum": 256},
             "allow_hosts": {"type": "array", "items": {"type": "string"},
                 "description": "Hosts the sandbox may reach through its egress proxy: name, *.suffix, IP or CIDR, optional :ports (default: no egress)"},
             "secrets": {"type": "object", "additionalProperties": {"type": "string"},
                 "description": "Environment variable -> name of a stored secret: the variable holds a placeholder, and the gateway adds the secret on HTTPS requests to the secret's hosts"},
             "volumes": {"type": "array", "description": "Volumes to mount (see volume_create): files there outlive the sandbox. One sandbox at a time may mount a volume read-write; any number read-only",
                 "items": {"type": "object", "properties": {
                     "name": {"type": "string", "description": "The volume's name"},
                     "path": {"type": "string", "description": "Absolute path inside the sandbox, such as /workspace"},
                     "read_only": {"type": "boolean", "description": "Default false"}},
                  "required": ["name", "path"], "additionalProperties": false}}},
          "additionalProperties": false}},
        {"name": "run_command",
         "description": "Run a shell command (or an argv) in a sandbox and wait for it: stdout, stderr and exit code.",
         "inputSchema": {"type": "object", "properties": {
             "sandbox_id": id,
             "command": {"type": "string", "description": "Run by /bin/sh -c"},
             "argv": {"type": "array", "items": {"type": "string"}},
             "cwd": {"type": "string"}, "env": env,
             "timeout_s": {"type": "integer", "minimum": 0}},
          "required": ["sandbox_id"], "additionalProperties": false}},
        {"name": "write_file",
         "description": "Write a text file in a sandbox (parents are created).",
         "inputSchema": {"type": "object", "properties": {
             "sandbox_id": id, "path": {"type": "string", "description": "Absolute path"},
             "content": {"type": "string"}},
          "required": ["sandbox_id", "path", "content"], "additionalProperties": false}},
        {"name": "read_file",
         "description": "Read a file from a sandbox.",
         "inputSchema": {"type": "object", "properties": {
             "sandbox_id": id, "path": {"type": "string", "description": "Absolute path"}},
          "required": ["sandbox_id", "path"], "additionalProperties": false}},
        {"name": "http_to_port",
         "description": "Send an HTTP request to a server listening on a port inside a sandbox (a dev server, an app you started there); returns the status and body.",
         "inputSchema": {"type": "object", "properties": {
             "sandbox_id": id, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
             "method": {"type": "string", "description": "Default GET"},
             "path": {"type": "string", "description": "Default /"},
             "body": {"type": "string"}},
          "required": ["sandbox_id", "port"], "additionalProperties": false}},
        {"name": "list_sandboxes", "description": "List sandboxes with their state.",
         "inputSchema": {"type": "object", "properties": {}, "additionalProperties": false}},
        {"name": "pause_sandbox", "description": "Freeze a sandbox in memory.", "inputSchema": only_id},
        {"name": "resume_sandbox", "description": "Resume a paused or suspended sandbox.", "inputSchema": only_id},
        {"name": "suspend_sandbox", "description": "Snapshot a sandbox to disk and stop it.", "inputSchema": only_id},
        {"name": "delete_sandbox", "description": "Delete a sandbox and everything it holds.", "inputSchema": only_id},
        {"name": "fork_sandbox",
         "description": "Copy a running sandbox (memory, running processes, files) at one instant into new sandboxes, to try several things from the same state. Returns the forks' ids.",
         "inputSchema": {"type": "object", "properties": {
             "sandbox_id": id, "count": {"type": "integer", "minimum": 1, "maximum": 16, "description": "Default 1"}},
          "required": ["sandbox_id"], "additionalProperties": false}},
        {"name": "checkpoint_sandbox",
         "description": "Save a named checkpoint of a running sandbox (memory, processes, files) without stopping it, to roll back to later.",
         "inputSchema": checkpoint},
        {"name": "run_code",
         "description": "Run Python in an interpreter kept alive in the sandbox (variables and imports persist between calls; the sandbox needs the code-interpreter template). Returns the output, the last expression's value, charts as images, or the error with its traceback.",
         "inputSchema": {"type": "object", "properties": {
             "sandbox_id": id, "code": {"type": "string"},
             "timeout_s": {"type": "integer", "minimum": 1, "description": "Interrupt the run after this long"}},
          "required": ["sandbox_id", "code"], "additionalProperties": false}},
        {"name": "restore_checkpoint",
         "description": "Roll a sandbox back to one of its checkpoints: memory, processes and files as they were then.",
         "inputSchema": checkpoint},
        {"name": "template_build",
         "description": "Build a template from a Dockerfile (FROM template:NAME, a registry image or scratch; RUN, COPY, ENV, WORKDIR, USER, CMD, multi-stage…) and the files its COPY lines name, and wait until it is ready. RUN steps have no network. Returns the template, or the failing step and line.",
         "inputSchema": {"type": "object", "properties": {
             "name": {"type": "string", "description": "The new template's name: a-z, 0-9, - and _"},
             "dockerfile": {"type": "string", "description": "The Dockerfile's text"},
             "files": {"type": "object", "additionalProperties": {"type": "string"},
                 "description": "The build context: relative path -> text content"},
             "build_args": {"type": "object", "additionalProperties": {"type": "string"}}},
          "required": ["name", "dockerfile"], "additionalProperties": false}},
        {"name": "template_from_image",
         "description": "Make a template of an image in an OCI registry (host/repo:tag or host/repo@sha256:…) and wait until it is ready; sandboxes are then created with that template. Returns the template (its defaults.command is the image's start command, which SPACE does not run).",
         "inputSchema": {"type": "object", "properties": {
             "name": {"type": "string", "description": "The new template's name: a-z, 0-9, - and _"},
             "image": {"type": "string", "description": "The image reference"},
             "registry_secret": {"type": "string", "description": "A stored secret holding the registry's password (with registry_user) or token"},
             "registry_user": {"type": "string"}},
          "required": ["name", "image"], "additionalProperties": false}},
        {"name": "volume_create",
         "description": "Make a volume: storage that outlives sandboxes, mounted into them with create_sandbox's `volumes` (a workspace to keep, or to hand from one sandbox to the next). Returns the volume.",
         "inputSchema": {"type": "object", "properties": {
             "name": volume,
             "size_mib": {"type": "integer", "minimum": 1, "description": "Its size quota (default 1024)"},
             "from_snapshot": {"type": "object", "description": "Start as a copy of this snapshot (see volume_snapshot)",
                 "properties": {"volume": {"type": "string"}, "snapshot": {"type": "string"}},
                 "required": ["volume", "snapshot"], "additionalProperties": false}},
          "required": ["name"], "additionalProperties": false}},
        {"name": "volume_list", "description": "List your volumes: size, use and the sandboxes that mount them.",
         "inputSchema": {"type": "object", "properties": {}, "additionalProperties": false}},
        {"name": "volume_delete",
         "description": "Delete a volume, its files and its snapshots (refused while a sandbox mounts it).",
         "inputSchema": {"type": "object", "properties": {"name": volume}, "required": ["name"], "additionalProperties": false}},
        {"name": "volume_snapshot",
         "description": "Snapshot a volume's files as they are now (cheap, copy-on-write), to make a new volume from later with volume_create's from_snapshot. Returns the snapshot.",
         "inputSchema": {"type": "object", "properties": {
             "volume": volume, "name": {"type": "string", "description": "Snapshot name: a-z, 0-9, - and _"}},
          "required": ["volume", "name"], "additionalProperties": false}},
    ])
}

fn text(value: &str) -> Value {
    json!({"content": [{"type": "text", "text": value}], "isError": false})
}

fn tool_error(message: &str) -> Value {
    json!({"content": [{"type": "text", "text": message}], "isError": true})
}

fn string<'a>(args: &'a Value, key: &str) -> Result<&'a str, String> {
    args[key].as_str().ok_or_else(|| format!("`{key}` (a string) is required"))
}

/// Waits for an accepted operation and says how it ended.
fn finish(client: &Client, accepted: &Value) -> Result<Value, String> {
    let id = accepted["operation"]["id"].as_str().ok_or("the server accepted no operation")?;
    let operation = client.wait_operation(id).map_err(|e| e.to_string())?;
    if operation["state"] != "succeeded" {
        return Err(format!(
            "the {} operation {}: {}",
            operation["kind"], operation["state"], operation["error"]["message"]
        ));
    }
    Ok(operation)
}

fn call(client: &Client, name: &str, args: &Value) -> Result<Value, String> {
    let e = |err: crate::client::ClientError| err.to_string();
    match name {
        "create_sandbox" => {
            let mut body = json!({"template": args["template"].as_str().unwrap_or("base")});
            for key in ["env", "vcpus", "memory_mib", "disk_mib", "volumes"] {
                if !args[key].is_null() {
                    body[key] = args[key].clone();
                }
            }
            let secrets: serde_json::Map<String, Value> = args["secrets"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(env, name)| (env.clone(), json!({"secret": name})))
                .collect();
            if args["allow_hosts"].as_array().is_some_and(|hosts| !hosts.is_empty()) || !secrets.is_empty() {
                let allow = args["allow_hosts"].as_array().cloned().unwrap_or_default();
                body["network"] = json!({"egress": "allowlist", "allow": allow, "secrets": secrets});
            }
            let accepted = client.post("/v1/sandboxes", &body).map_err(e)?;
            finish(client, &accepted)?;
            let id = accepted["sandbox"]["id"].as_str().unwrap_or_default();
            let sandbox = client.get(&format!("/v1/sandboxes/{id}")).map_err(e)?;
            Ok(text(&serde_json::to_string_pretty(&sandbox).unwrap_or_default()))
        }
        "run_command" => {
            let id = string(args, "sandbox_id")?;
            let mut body = json!({});
            match (args["command"].as_str(), args["argv"].as_array()) {
                (Some(command), None) => body["cmd"] = command.into(),
                (None, Some(argv)) => body["argv"] = Value::Array(argv.clone()),
                _ => return Err("give either `command` (a shell string) or `argv` (a list)".into()),
            }
            for key in ["cwd", "env", "timeout_s"] {
                if !args[key].is_null() {
                    body[key] = args[key].clone();
                }
            }
            let answer = client.post(&format!("/v1/sandboxes/{id}/exec"), &body).map_err(e)?;
            let result = &answer["result"];
            let summary = json!({
                "exit_code": result["exit_code"], "signal": result["signal"], "timed_out": result["timed_out"],
                "stdout": answer["stdout"], "stderr": answer["stderr"], "truncated": answer["truncated"],
            });
            Ok(text(&serde_json::to_string_pretty(&summary).unwrap_or_default()))
        }
        "write_file" => {
            let (id, path, content) = (string(args, "sandbox_id")?, string(args, "path")?, string(args, "content")?);
            client.upload_bytes(id, path, content.as_bytes()).map_err(e)?;
            Ok(text(&format!("wrote {} bytes to {path}", content.len())))
        }
        "read_file" => {
            let (id, path) = (string(args, "sandbox_id")?, string(args, "path")?);
            let mut bytes = Vec::new();
            client.download(id, path, &mut bytes).map_err(e)?;
            Ok(text(&String::from_utf8_lossy(&bytes)))
        }
        "http_to_port" => {
            let id = string(args, "sandbox_id")?;
            let port = args["port"].as_u64().filter(|p| (1..=65535).contains(p)).ok_or("`port` is 1 to 65535")?;
            let method = args["method"].as_str().unwrap_or("GET").to_ascii_uppercase();
            let path = args["path"].as_str().unwrap_or("/").trim_start_matches('/');
            let (status, body) = client
                .exchange(&method, &format!("/v1/sandboxes/{id}/ports/{port}/{path}"), args["body"].as_str())
                .map_err(e)?;
            Ok(text(&format!("HTTP {status}\n{body}")))
        }
        "list_sandboxes" => {
            let list = client.get("/v1/sandboxes").map_err(e)?;
            let rows: Vec<Value> = list["sandboxes"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| json!({"id": s["id"], "state": s["state"], "template": s["template"]}))
                .collect();
            Ok(text(&serde_json::to_string_pretty(&rows).unwrap_or_default()))
        }
        "pause_sandbox" | "resume_sandbox" | "suspend_sandbox" | "delete_sandbox" => {
            let id = string(args, "sandbox_id")?;
            let action = name.trim_end_matches("_sandbox");
            let accepted = if action == "delete" {
                client.delete(&format!("/v1/sandboxes/{}", encode(id))).map_err(e)?
            } else {
                client.post(&format!("/v1/sandboxes/{}/{action}", encode(id)), &json!({})).map_err(e)?
            };
            finish(client, &accepted)?;
            let past = match action {
                "pause" => "paused",
                "resume" => "resumed",
                "suspend" => "suspended",
                _ => "deleted",
            };
            Ok(text(&format!("{id} {past}")))
        }
        "fork_sandbox" => {
            let id = string(args, "sandbox_id")?;
            let body = json!({"count": args["count"].as_u64().unwrap_or(1)});
            let accepted = client.post(&format!("/v1/sandboxes/{}/fork", encode(id)), &body).map_err(e)?;
            finish(client, &accepted)?;
            let forks: Vec<Value> =
                accepted["sandboxes"].as_array().into_iter().flatten().map(|s| s["id"].clone()).collect();
            Ok(text(&serde_json::to_string_pretty(&json!({"forks": forks})).unwrap_or_default()))
        }
        "template_build" => {
            let (template, dockerfile) = (string(args, "name")?, string(args, "dockerfile")?);
            let mut tar = tar::Builder::new(Vec::new());
            for (path, content) in args["files"].as_object().into_iter().flatten() {
                let content = content.as_str().ok_or_else(|| format!("files.{path} is a string"))?;
                let mut header = tar::Header::new_gnu();
                header.set_size(content.len() as u64);
                header.set_mode(0o644);
                tar.append_data(&mut header, path, content.as_bytes()).map_err(|e| format!("files.{path}: {e}"))?;
            }
            let context = tar.into_inner().map_err(|e| e.to_string())?;
            let request = json!({"name": template, "dockerfile": dockerfile,
                "build_args": args["build_args"].as_object().cloned().unwrap_or_default()});
            let accepted =
                crate::cmd::template::post_build_form(client, &request, &context[..]).map_err(|e| e.to_string())?;
            finish(client, &accepted)?;
            let made = client.get(&format!("/v1/templates/{}", encode(template))).map_err(e)?;
            Ok(text(&serde_json::to_string_pretty(&made).unwrap_or_default()))
        }
        "template_from_image" => {
            let (template, image) = (string(args, "name")?, string(args, "image")?);
            let image = match (args["registry_secret"].as_str(), args["registry_user"].as_str()) {
                (Some(secret), user) => json!({"reference": image, "auth": {"secret": secret, "username": user}}),
                (None, Some(_)) => return Err("`registry_user` goes with `registry_secret`".into()),
                (None, None) => json!(image),
            };
            let accepted =
                client.post("/v1/templates", &json!({"name": template, "from": {"image": image}})).map_err(e)?;
            finish(client, &accepted)?;
            let made = client.get(&format!("/v1/templates/{}", encode(template))).map_err(e)?;
            Ok(text(&serde_json::to_string_pretty(&made).unwrap_or_default()))
        }
        "checkpoint_sandbox" | "restore_checkpoint" => {
            let (id, checkpoint) = (encode(string(args, "sandbox_id")?), string(args, "name")?);
            let (path, body) = match name {
                "checkpoint_sandbox" => (format!("/v1/sandboxes/{id}/checkpoints"), json!({"name": checkpoint})),
                _ => (format!("/v1/sandboxes/{id}/checkpoints/{}/restore", encode(checkpoint)), json!({})),
            };
            finish(client, &client.post(&path, &body).map_err(e)?)?;
            let done = if name == "checkpoint_sandbox" { "saved" } else { "restored" };
            Ok(text(&format!("checkpoint {checkpoint} {done}")))
        }
        "run_code" => {
            let id = encode(string(args, "sandbox_id")?);
            let code = string(args, "code")?;
            let base = format!("/v1/sandboxes/{id}/contexts");
            // The sandbox's live context, so state carries from call to call.
            let listed = client.get(&base).map_err(e)?;
            let live = listed["contexts"].as_array().into_iter().flatten().find(|c| c["state"] != "dead").cloned();
            let context = match live {
                Some(context) => context,
                None => client.post(&base, &json!({"language": "python"})).map_err(e)?,
            };
            let path = format!("{base}/{}/run", context["id"].as_str().unwrap_or_default());
            let body = json!({"code": code, "timeout_s": args["timeout_s"]});
            let reader = client.post_reader(&path, &body).map_err(e)?;
            let (mut text, mut content) = (String::new(), Vec::new());
            let mut failed = false;
            for line in std::io::BufReader::new(reader).lines() {
                let event: Value =
                    serde_json::from_str(&line.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
                match event["type"].as_str() {
                    Some("stdout" | "stderr") => text.push_str(event["text"].as_str().unwrap_or_default()),
                    Some("result") => {
                        let data = &event["data"];
                        if let Some(png) = data["image/png"].as_str() {
                            content.push(json!({"type": "image", "data": png.trim(), "mimeType": "image/png"}));
                        } else if let Some(value) = data["text/plain"].as_str() {
                            text.push_str(&format!("{value}\n"));
                        }
                    }
                    Some("error") => {
                        failed = true;
                        let lines: Vec<&str> =
                            event["traceback"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
                        text.push_str(&lines.join("\n"));
                    }
                    Some("end") if event["status"] != "ok" && event["status"] != "error" => {
                        failed = true;
                        text.push_str(&format!("\n(the run ended: {})", event["status"].as_str().unwrap_or("?")));
                    }
                    _ => {}
                }
            }
            content.insert(0, json!({"type": "text", "text": text}));
            Ok(json!({"content": content, "isError": failed}))
        }
        "volume_create" => {
            let mut body = json!({"name": string(args, "name")?});
            for key in ["size_mib", "from_snapshot"] {
                if !args[key].is_null() {
                    body[key] = args[key].clone();
                }
            }
            let made = client.post("/v1/volumes", &body).map_err(e)?;
            Ok(text(&serde_json::to_string_pretty(&made).unwrap_or_default()))
        }
        "volume_list" => {
            let list = client.get("/v1/volumes").map_err(e)?;
            let rows: Vec<Value> = list["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|v| {
                    json!({"name": v["name"], "size_mib": v["size_mib"], "used_bytes": v["used_bytes"],
                           "mounted_by": v["mounted_by"],
                           "snapshots": v["snapshots"].as_array().into_iter().flatten().map(|s| s["name"].clone()).collect::<Vec<_>>()})
                })
                .collect();
            Ok(text(&serde_json::to_string_pretty(&rows).unwrap_or_default()))
        }
        "volume_delete" => {
            let volume = string(args, "name")?;
            client.delete_empty(&format!("/v1/volumes/{}", encode(volume))).map_err(e)?;
            Ok(text(&format!("volume {volume} deleted")))
        }
        "volume_snapshot" => {
            let (volume, snapshot) = (string(args, "volume")?, string(args, "name")?);
            let made = client
                .post(&format!("/v1/volumes/{}/snapshots", encode(volume)), &json!({"name": snapshot}))
                .map_err(e)?;
            Ok(text(&serde_json::to_string_pretty(&made).unwrap_or_default()))
        }
        other => Err(format!("no tool {other:?}")),
    }
}

/// One JSON-RPC message in, its answer (none for a notification) out.
fn handle(client: &Client, message: &Value) -> Option<Value> {
    let id = message.get("id").cloned();
    let reply = |result: Result<Value, (i64, String)>| {
        let id = id.clone()?;
        Some(match result {
            Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Err((code, message)) => json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}),
        })
    };
    let method = message["method"].as_str().unwrap_or("");
    match method {
        "initialize" => reply(Ok(json!({
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": {"name": "space", "version": env!("CARGO_PKG_VERSION")},
            "instructions": "Isolated Linux sandboxes: create one, run commands and move files in it, then delete it. Files to keep beyond a sandbox go in a volume it mounts.",
        }))),
        "ping" => reply(Ok(json!({}))),
        "tools/list" => reply(Ok(json!({"tools": tools()}))),
        "tools/call" => {
            let params = &message["params"];
            let Some(name) = params["name"].as_str() else {
                return reply(Err((-32602, "tools/call needs params.name".into())));
            };
            let args = if params["arguments"].is_null() { json!({}) } else { params["arguments"].clone() };
            reply(Ok(call(client, name, &args).unwrap_or_else(|message| tool_error(&message))))
        }
        _ if method.starts_with("notifications/") => None,
        _ => reply(Err((-32601, format!("no method {method:?}")))),
    }
}

/// Serves MCP on stdin/stdout until stdin closes.
pub fn serve(client: &Client) -> Result<()> {
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let answer = match serde_json::from_str::<Value>(&line) {
            Ok(message) => handle(client, &message),
            Err(err) => Some(json!({"jsonrpc": "2.0", "id": null,
                                    "error": {"code": -32700, "message": format!("not JSON: {err}")}})),
        };
        if let Some(answer) = answer {
            writeln!(stdout, "{answer}")?;
            stdout.flush()?;
        }
    }
    Ok(())
}
