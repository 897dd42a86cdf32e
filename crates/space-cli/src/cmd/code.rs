//! `space exec` (a command in a sandbox) and `space run` (code in a
//! sandbox's code context).

use anyhow::{Context, Result};

use super::signal_number;
use crate::attach;
use crate::cli::{ExecArgs, RunArgs};

pub(crate) fn run_code(args: RunArgs) -> Result<i32> {
    use std::io::{Read, Write};
    let client = args.client.client()?;
    let base = format!("/v1/sandboxes/{}/contexts", args.sandbox);
    let code = match args.code.as_str() {
        "-" => {
            let mut code = String::new();
            std::io::stdin().read_to_string(&mut code)?;
            code
        }
        code => code.to_string(),
    };
    let _ = args.python; // Python is the one language so far.
    let (context, made) = match args.context {
        Some(context) => (context, false),
        None => {
            let made = client.post(&base, &serde_json::json!({"language": "python"}))?;
            (made["id"].as_str().unwrap_or_default().to_string(), true)
        }
    };
    let body = serde_json::json!({"code": code, "timeout_s": args.timeout});
    let mut code = 0;
    let reader = client.post_reader(&format!("{base}/{context}/run"), &body)?;
    for line in std::io::BufRead::lines(std::io::BufReader::new(reader)) {
        let event: serde_json::Value = serde_json::from_str(&line?)?;
        match event["type"].as_str() {
            Some("stdout") => print!("{}", event["text"].as_str().unwrap_or_default()),
            Some("stderr") => eprint!("{}", event["text"].as_str().unwrap_or_default()),
            Some("result") => {
                let data = &event["data"];
                if let Some(text) = data["text/plain"].as_str().filter(|_| event["is_main_result"] == true) {
                    println!("{text}");
                }
                for (mime, value) in data.as_object().into_iter().flatten() {
                    if mime.starts_with("image/") {
                        eprintln!("[{mime}, {} bytes base64]", value.as_str().map_or(0, str::len));
                    }
                }
            }
            Some("error") => {
                for line in event["traceback"].as_array().into_iter().flatten() {
                    eprintln!("{}", line.as_str().unwrap_or_default());
                }
                code = 1;
            }
            Some("end") if event["status"] != "ok" && code == 0 => {
                eprintln!("the run ended: {}", event["status"].as_str().unwrap_or("unknown"));
                code = 1;
            }
            _ => {}
        }
        std::io::stdout().flush()?;
    }
    if made {
        let _ = client.delete_empty(&format!("{base}/{context}"));
    }
    Ok(code)
}

pub(crate) fn exec(args: ExecArgs) -> Result<i32> {
    let client = args.client.client()?;
    let request = space_api::CommandRequest {
        argv: Some(args.argv),
        env: args.env.into_iter().collect(),
        cwd: args.cwd,
        timeout_s: args.timeout.unwrap_or(0),
        // Left out with `-t` alone: the terminal is the command's stdin.
        stdin: args.interactive.then_some(true),
        tty: args.tty,
        ..Default::default()
    };
    let created = client.post(&format!("/v1/sandboxes/{}/commands", args.sandbox), &serde_json::to_value(&request)?)?;
    if args.interactive || args.tty {
        let attach = created["command"]["attach"]["ws"].as_str().context("no attach link in the answer")?;
        let command =
            format!("/v1/sandboxes/{}/commands/{}", args.sandbox, created["command"]["id"].as_str().unwrap_or(""));
        return attach::interactive(&client, attach, &command, args.tty);
    }
    let output_path =
        created["command"]["attach"]["output"].as_str().context("no output link in the answer")?.to_string();
    let result = client.stream_output(&output_path, &mut std::io::stdout().lock(), &mut std::io::stderr())?;
    if let Some(error) = result.error.as_deref() {
        eprintln!("space: {error}");
    }
    Ok(match (result.exit_code, result.signal.as_deref()) {
        (Some(code), _) => code,
        (None, Some(signal)) => {
            eprintln!("space: the command was killed by SIG{signal}");
            128 + signal_number(signal)
        }
        (None, None) => 255,
    })
}
