//! `moec serve` end to end on the tiny card: a server on a free loopback port, spoken to
//! with plain HTTP/1.1 over a `TcpStream` (what any client sends). Greedy completions equal
//! `moec run`'s continuation of the same prompt with the same schedule; 16 concurrent
//! streaming clients each get what they get alone; a client that goes away is cancelled
//! and its sequence freed; every bad request is a 4xx with OpenAI's error body and the
//! server keeps serving; with VSLPipe a request that arrives while another decodes gets
//! its first token before the other's last; SIGTERM with requests in flight exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One cache for every server and run of this file, so the tiny checkpoint is written once.
fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-cache")
}

fn moec() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_moec"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache())
        .env_remove("MOEC_API_KEY");
    c
}

/// A running `moec serve`, killed when dropped (a test that failed mid-way leaves no
/// server behind).
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(sched: &str, extra: &[&str]) -> Server {
    serve_with_env(sched, extra, &[])
}

/// [`serve`] with environment variables set for the server.
fn serve_with_env(sched: &str, extra: &[&str], env: &[(&str, &Path)]) -> Server {
    let mut command = moec();
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command
        .args([
            "serve",
            sched,
            "--port",
            "0",
            "--hw",
            "t4",
            "--threads",
            "2",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("moec serve starts");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("the server says where it listens");
    let addr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .parse()
        .expect("an address");
    Server { child, addr }
}

/// A response: status, headers (lower-case names), body.
struct Reply {
    status: u16,
    body: String,
}

impl Reply {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // A server may answer (413) before reading a large body, and close: a failed write
    // of the rest is fine.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {head:?}"));
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Reply {
        status,
        body: if chunked {
            dechunk(body)
        } else {
            body.to_string()
        },
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn post(addr: SocketAddr, path: &str, body: &serde_json::Value, key: Option<&str>) -> Reply {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    request(addr, "POST", path, &headers, body.to_string().as_bytes())
}

/// A streaming completion read event by event: `on_text` is called per text piece with
/// the time it arrived; returns the whole text and the finish reason.
fn stream(
    addr: SocketAddr,
    body: &serde_json::Value,
    key: Option<&str>,
    mut on_text: impl FnMut(&str, Instant),
) -> (String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.to_string();
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains(" 200 "), "status line {line:?}");
    let (mut text, mut finish) = (String::new(), String::new());
    let mut done = false;
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        let Some(data) = line.trim().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(data).expect("a JSON chunk");
        let choice = &chunk["choices"][0];
        if let Some(t) = choice["text"].as_str().filter(|t| !t.is_empty()) {
            on_text(t, Instant::now());
            text.push_str(t);
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    assert!(done, "the stream ended without data: [DONE]");
    (text, finish)
}

fn metric(addr: SocketAddr, name: &str, key: Option<&str>) -> f64 {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let reply = request(addr, "GET", "/metrics", &headers, b"");
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply
        .body
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in {}", reply.body))
}

/// One sample of a Prometheus text exposition: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Parses Prometheus' text format (version 0.0.4) strictly enough to catch what a scraper
/// rejects: every sample belongs to a family declared by `# TYPE` before it (a histogram's
/// `_bucket`, `_sum` and `_count`), names and label names are valid, label values are
/// quoted, values are numbers, no family is declared twice; a histogram's buckets are
/// cumulative with ascending `le` ending at `+Inf`, which equals its `_count`.
fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    use std::collections::HashMap;
    let valid_name = |n: &str| {
        !n.is_empty()
            && n.chars().enumerate().all(|(i, c)| {
                c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
            })
    };
    let mut types: HashMap<String, String> = HashMap::new();
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = |why: String| format!("line {}: {why}: {line:?}", n + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| at("TYPE".into()))?;
            if !valid_name(name) {
                return Err(at(format!("bad name {name}")));
            }
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                return Err(at(format!("bad type {kind}")));
            }
            if types.insert(name.to_string(), kind.to_string()).is_some() {
                return Err(at(format!("{name} declared twice")));
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').ok_or_else(|| at("no value".into()))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse::<f64>()
                .map_err(|e| at(format!("value {v}: {e}")))?,
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, Vec::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .ok_or_else(|| at("unclosed labels".into()))?;
                let mut labels = Vec::new();
                for pair in body.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once('=')
                        .ok_or_else(|| at(format!("label {pair}")))?;
                    let v = v
                        .strip_prefix('"')
                        .and_then(|v| v.strip_suffix('"'))
                        .ok_or_else(|| at(format!("unquoted label value {v}")))?;
                    if !valid_name(k) {
                        return Err(at(format!("bad label name {k}")));
                    }
                    labels.push((k.to_string(), v.to_string()));
                }
                (name, labels)
            }
        };
        if !valid_name(name) {
            return Err(at(format!("bad name {name}")));
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|base| types.get(*base).is_some_and(|k| k == "histogram"))
            })
            .unwrap_or(name);
        let kind = types
            .get(family)
            .ok_or_else(|| at(format!("{name} has no # TYPE before it")))?;
        if kind == "histogram"
            && name.ends_with("_bucket")
            && !labels.iter().any(|(k, _)| k == "le")
        {
            return Err(at("a bucket without le".into()));
        }
        if kind == "counter" && value < 0.0 {
            return Err(at("a negative counter".into()));
        }
        samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    for (family, kind) in &types {
        if kind != "histogram" {
            continue;
        }
        let bucket = format!("{family}_bucket");
        let buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.name == bucket)
            .map(|s| {
                let le = &s.labels.iter().find(|(k, _)| k == "le").expect("le").1;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                (le, s.value)
            })
            .collect();
        if buckets.last().map(|b| b.0) != Some(f64::INFINITY) {
            return Err(format!("{family}: no +Inf bucket last"));
        }
        if buckets.windows(2).any(|w| {
            w[0].0.partial_cmp(&w[1].0) != Some(std::cmp::Ordering::Less) || w[0].1 > w[1].1
        }) {
            return Err(format!(
                "{family}: buckets not ascending and cumulative: {buckets:?}"
            ));
        }
        let count = samples
            .iter()
            .find(|s| s.name == format!("{family}_count"))
            .ok_or_else(|| format!("{family}: no _count"))?;
        if buckets.last().map(|b| b.1) != Some(count.value) {
            return Err(format!("{family}: +Inf bucket is not _count"));
        }
        if !samples.iter().any(|s| s.name == format!("{family}_sum")) {
            return Err(format!("{family}: no _sum"));
        }
    }
    Ok(samples)
}

/// The server's `/metrics`, parsed (the test fails on anything a scraper would reject).
fn scrape(addr: SocketAddr, key: Option<&str>) -> Vec<Sample> {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let reply = request(addr, "GET", "/metrics", &headers, b"");
    assert_eq!(reply.status, 200, "{}", reply.body);
    parse_prometheus(&reply.body).unwrap_or_else(|e| panic!("{e}\n{}", reply.body))
}

/// The value of the sample `name` with exactly `labels`.
fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && s.labels.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(k2, v2)| k2 == k && v2 == v))
        })
        .map(|s| s.value)
        .unwrap_or_else(|| panic!("no {name} {labels:?}"))
}

#[test]
fn the_prometheus_parser_rejects_what_scrapers_reject() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total 3\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 2.5\nh_count 2\n";
    let samples = parse_prometheus(good).expect("valid");
    assert_eq!(sample(&samples, "h_bucket", &[("le", "+Inf")]), 2.0);
    for bad in [
        "a 1\n",
        "# TYPE a gauge\na one\n",
        "# TYPE a gauge\na{x=1} 1\n",
        "# TYPE 1a gauge\n",
        "# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n",
        "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n",
        "# TYPE a gauge\n# TYPE a gauge\n",
    ] {
        assert!(parse_prometheus(bad).is_err(), "{bad:?} parsed");
    }
}

/// `moec run`'s continuation of `prompt`, greedy, `gen` tokens.
fn run_text(sched: &str, prompt: &str, gen: usize) -> String {
    let out = moec()
        .args([
            "run",
            sched,
            "--json",
            "--hw",
            "t4",
            "--gen-len",
            &gen.to_string(),
            "--prompt",
            prompt,
        ])
        .output()
        .expect("moec run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    doc["outputs"][0]["text"]
        .as_str()
        .expect("a text")
        .to_string()
}

const KEY: &str = "test-key-0123";

/// The fixed-batch schedule (CGOPipe): equality with `moec run`, concurrent streams, every
/// refusal, the API key, a client that leaves.
#[test]
fn cgopipe_serves_openai_completions_and_refuses_bad_requests() {
    let sched = "schedules/cgopipe.sched";
    let server = serve(
        sched,
        &[
            "--max-batch",
            "4",
            "--max-prompt",
            "24",
            "--max-tokens",
            "12",
            "--api-key",
            KEY,
            "--max-body",
            "65536",
        ],
    );
    let addr = server.addr;
    let key = Some(KEY);
    let prompts = [
        "The capital of France is",
        "Mixture of experts",
        "Once upon a time",
        "The quick brown fox",
    ];
    let expected: Vec<String> = prompts.iter().map(|p| run_text(sched, p, 6)).collect();

    // Non-streaming, greedy: moec run's continuation, with usage.
    let reply = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"model": "x", "prompt": prompts[0], "max_tokens": 6, "temperature": 0}),
        key,
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    let doc = reply.json();
    assert_eq!(doc["choices"][0]["text"], expected[0].as_str());
    assert_eq!(doc["object"], "text_completion");
    assert!(doc["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(doc["usage"]["completion_tokens"].as_u64().unwrap() <= 6);

    // Sixteen concurrent streams (the four prompts four times each, more than the batch of
    // four holds at once, so most wait in the queue): each gets exactly what it gets alone.
    let got: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .cycle()
            .take(16)
            .map(|p| {
                s.spawn(move || {
                    let body = serde_json::json!({"prompt": p, "max_tokens": 6, "temperature": 0, "stream": true});
                    stream(addr, &body, Some(KEY), |_, _| {}).0
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<String> = expected.iter().cycle().take(16).cloned().collect();
    assert_eq!(got, want);

    // The metrics count what ran, in a format a Prometheus scraper takes: 17 completions
    // so far, each with a first token, and one inter-token time per later token.
    let m = scrape(addr, key);
    let generated = sample(&m, "moec_generated_tokens_total", &[]);
    assert_eq!(
        sample(&m, "moec_time_to_first_token_seconds_count", &[]),
        17.0
    );
    assert_eq!(
        sample(&m, "moec_inter_token_seconds_count", &[]),
        generated - 17.0
    );
    assert_eq!(
        sample(&m, "moec_request_completion_tokens_total", &[]),
        generated
    );
    let finished: f64 = ["stop", "length"]
        .iter()
        .map(|r| sample(&m, "moec_requests_finished_total", &[("reason", r)]))
        .sum();
    assert_eq!(finished, 17.0);
    assert!(sample(&m, "moec_time_to_first_token_seconds_sum", &[]) > 0.0);
    assert_eq!(sample(&m, "moec_kv_blocks_used", &[]), 0.0);
    assert_eq!(
        sample(&m, "moec_kv_blocks_free", &[]),
        sample(&m, "moec_kv_blocks_total", &[])
    );
    assert!(sample(&m, "moec_kv_blocks_used_peak", &[]) > 0.0);
    assert_eq!(sample(&m, "moec_queue_length", &[]), 0.0);
    assert!(metric(addr, "moec_generated_tokens_total", key) > 0.0);
    assert!(metric(addr, "moec_tokens_per_second", key) > 0.0);
    assert!(metric(addr, "moec_step_seconds_last", key) > 0.0);
    assert_eq!(metric(addr, "moec_running_sequences", key), 0.0);
    assert!(metric(addr, "moec_arena_bytes{space=\"host\"}", key) > 0.0);

    // Refusals: each a 4xx with an OpenAI error body.
    let bad: Vec<(&str, Vec<u8>, Option<&str>, u16)> = vec![
        ("malformed JSON", b"{\"prompt\": ".to_vec(), key, 400),
        (
            "wrong type",
            br#"{"prompt": "hi", "max_tokens": "many"}"#.to_vec(),
            key,
            400,
        ),
        ("missing prompt", br#"{"max_tokens": 3}"#.to_vec(), key, 400),
        (
            "max_tokens 0",
            br#"{"prompt": "hi", "max_tokens": 0}"#.to_vec(),
            key,
            400,
        ),
        (
            "max_tokens 10^9",
            br#"{"prompt": "hi", "max_tokens": 1000000000}"#.to_vec(),
            key,
            400,
        ),
        ("n = 2", br#"{"prompt": "hi", "n": 2}"#.to_vec(), key, 400),
        (
            "prompt too long",
            serde_json::json!({"prompt": "word ".repeat(200), "max_tokens": 2})
                .to_string()
                .into_bytes(),
            key,
            400,
        ),
        (
            "10 MB body",
            format!("{{\"prompt\": \"{}\"}}", "a".repeat(10 << 20)).into_bytes(),
            key,
            413,
        ),
        ("no key", br#"{"prompt": "hi"}"#.to_vec(), None, 401),
        (
            "wrong key",
            br#"{"prompt": "hi"}"#.to_vec(),
            Some("test-key-0124"),
            401,
        ),
    ];
    for (what, body, k, status) in bad {
        let auth = k.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        let reply = request(addr, "POST", "/v1/completions", &headers, &body);
        assert_eq!(reply.status, status, "{what}: {}", reply.body);
        let doc = reply.json();
        assert!(
            doc["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: {}",
            reply.body
        );
        assert!(doc["error"]["type"].is_string(), "{what}");
    }
    // Chat without a template in the checkpoint: a 400 that says so.
    let reply = post(
        addr,
        "/v1/chat/completions",
        &serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
        key,
    );
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.body.contains("chat template"), "{}", reply.body);
    // Still serving.
    assert_eq!(request(addr, "GET", "/health", &[], b"").status, 200);
    let models = request(
        addr,
        "GET",
        "/v1/models",
        &[("Authorization", &format!("Bearer {KEY}"))],
        b"",
    );
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["object"], "model");
    // CGOPipe prefills into the GPU's cache lines, not the cache its decode reads.
    assert_eq!(models.json()["data"][0]["prefix_cache"], false);
    let again = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": prompts[1], "max_tokens": 6, "temperature": 0}),
        key,
    );
    assert_eq!(again.json()["choices"][0]["text"], expected[1].as_str());

    // And the next request is admitted and served.
    let after = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": prompts[3], "max_tokens": 6, "temperature": 0}),
        key,
    );
    assert_eq!(after.json()["choices"][0]["text"], expected[3].as_str());
}

/// VSLPipe admits a request that arrives while another decodes (its first token comes
/// before the other's last), a client that leaves mid-stream is cancelled and its
/// sequence freed (the next request is served), and SIGTERM with requests in flight exits 0 with every
/// stream ended cleanly.
#[test]
fn vslpipe_admits_while_decoding_and_sigterm_exits_zero() {
    let sched = "schedules/vslpipe.sched";
    let mut server = serve(
        sched,
        &[
            "--max-batch",
            "4",
            "--max-prompt",
            "16",
            "--max-tokens",
            "48",
            "--set",
            "seqs=4",
        ],
    );
    let addr = server.addr;
    let long = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": true});
    let short = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "stream": true});
    let (first_of_second, last_of_first) = std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let a = s.spawn(move || {
            let mut last = None;
            let mut told = false;
            stream(addr, &long, None, |_, at| {
                last = Some(at);
                if !told {
                    told = true;
                    let _ = tx.send(());
                }
            });
            last.expect("the long request produced text")
        });
        // The second request is sent once the first is decoding.
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the long request started");
        let b = s.spawn(move || {
            let mut first = None;
            stream(addr, &short, None, |_, at| {
                first.get_or_insert(at);
            });
            first.expect("the short request produced text")
        });
        (b.join().unwrap(), a.join().unwrap())
    });
    assert!(
        first_of_second < last_of_first,
        "the second request waited for the first to finish"
    );

    // A client that leaves mid-stream: its sequence is cancelled and freed.
    let before = metric(addr, "moec_cancelled_total", None);
    {
        let mut s = TcpStream::connect(addr).unwrap();
        let body = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": true}).to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        // Headers only come after the first token: the sequence is running.
        let mut first = [0u8; 16];
        s.read_exact(&mut first).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let running = metric(addr, "moec_running_sequences", None);
        let cancelled = metric(addr, "moec_cancelled_total", None);
        if running == 0.0 && cancelled > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sequence of a client that left still runs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let next = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
        None,
    );
    assert_eq!(next.status, 200, "{}", next.body);

    // SIGTERM while a stream runs: the stream ends cleanly, the server exits 0.
    let body = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": true});
    let pid = server.child.id().to_string();
    let (started_tx, started) = std::sync::mpsc::channel::<()>();
    let client = std::thread::spawn(move || {
        stream(addr, &body, None, |_, _| {
            let _ = started_tx.send(());
        })
    });
    started
        .recv_timeout(Duration::from_secs(60))
        .expect("the request is in flight");
    let kill = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = server.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status}");
    let (_, finish) = client.join().expect("the client ended cleanly");
    assert!(
        ["length", "stop", "cancelled"].contains(&finish.as_str()),
        "finish reason {finish:?}"
    );
}

/// Where the real `openai` Python package is: `MOEC_OPENAI_PYTHONPATH` (`.ci/run` installs
/// it there from PyPI), the system's, or installed here with pip into the target folder.
/// `None` (the test skips, saying why) only when there is no Python with pip.
fn openai_python() -> Option<Option<String>> {
    let importable = |path: Option<&str>| {
        let mut c = Command::new("python3");
        c.args(["-c", "import openai"]);
        if let Some(p) = path {
            c.env("PYTHONPATH", p);
        }
        c.output().is_ok_and(|o| o.status.success())
    };
    if let Ok(path) = std::env::var("MOEC_OPENAI_PYTHONPATH") {
        assert!(
            importable(Some(&path)),
            "MOEC_OPENAI_PYTHONPATH={path} has no openai package"
        );
        return Some(Some(path));
    }
    if importable(None) {
        return Some(None);
    }
    let pip = Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output();
    if !pip.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: no python3 with pip to install the openai client");
        return None;
    }
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-py");
    let target_str = target.to_str().expect("a UTF-8 path").to_string();
    if !importable(Some(&target_str)) {
        let out = Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--target",
                &target_str,
                "openai==2.8.0",
            ])
            .output()
            .expect("pip runs");
        assert!(
            out.status.success(),
            "pip install openai: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Some(Some(target_str))
}

/// A synthetic mixtral-tiny checkpoint in `dir/tiny` with a `tokenizer_config.json`
/// carrying a Mixtral-style chat template (`[INST] .. [/INST]`), for the chat tests.
fn chat_checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    let weights = dir.join("tiny");
    let synth = moec()
        .args([
            "synth",
            "--model",
            "mixtral-tiny",
            "--out",
            weights.to_str().unwrap(),
        ])
        .output()
        .expect("moec synth");
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    std::fs::write(
        weights.join("tokenizer_config.json"),
        serde_json::json!({
            "bos_token": "<s>",
            "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'].strip() }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
        })
        .to_string(),
    )
    .unwrap();
    weights
}

/// The real `openai` Python client against the server: completions and chat completions
/// (the chat template from the checkpoint's `tokenizer_config.json`), streaming and not;
/// the greedy completion equals `moec run`'s, and a chat streamed equals the chat whole.
#[test]
fn openai_python_client_gets_completions_and_chats() {
    let Some(pythonpath) = openai_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let weights = chat_checkpoint(dir.path());
    let sched = "schedules/cgopipe.sched";
    let w = weights.to_str().unwrap();
    let server = serve(
        sched,
        &[
            "--weights",
            w,
            "--max-batch",
            "2",
            "--max-prompt",
            "32",
            "--max-tokens",
            "8",
            "--api-key",
            KEY,
            "--max-connections",
            "1",
        ],
    );
    let prompt = "The capital of France is";
    let expected = {
        let out = moec()
            .args([
                "run",
                sched,
                "--weights",
                w,
                "--json",
                "--hw",
                "t4",
                "--gen-len",
                "6",
                "--prompt",
                prompt,
            ])
            .output()
            .expect("moec run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        doc["outputs"][0]["text"].as_str().unwrap().to_string()
    };
    let script = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
out = {}
c = client.completions.create(model="m", prompt=sys.argv[3], max_tokens=6, temperature=0)
out["completion"] = c.choices[0].text
out["usage"] = c.usage.completion_tokens
out["streamed"] = "".join(ch.choices[0].text for ch in client.completions.create(
    model="m", prompt=sys.argv[3], max_tokens=6, temperature=0, stream=True) if ch.choices)
msgs = [{"role": "user", "content": "  Hello there  "}]
chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0)
out["chat"] = chat.choices[0].message.content
out["chat_finish"] = chat.choices[0].finish_reason
out["chat_streamed"] = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
    model="m", messages=msgs, max_tokens=5, temperature=0, stream=True) if ch.choices)
try:
    client.completions.create(model="m", prompt="hi", max_tokens=10**9)
    out["refused"] = None
except Exception as e:
    out["refused"] = getattr(e, "status_code", str(e))
print(json.dumps(out))
"#;
    let mut python = Command::new("python3");
    python.args([
        "-c",
        script,
        &format!("http://{}/v1", server.addr),
        KEY,
        prompt,
    ]);
    if let Some(p) = &pythonpath {
        python.env("PYTHONPATH", p);
    }
    let out = python.output().expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script's JSON");
    assert_eq!(got["completion"], expected.as_str());
    assert_eq!(got["streamed"], expected.as_str());
    assert!(got["usage"].as_u64().is_some_and(|n| (1..=6).contains(&n)));
    assert!(got["chat"].as_str().is_some());
    assert_eq!(got["chat"], got["chat_streamed"]);
    assert!(["length", "stop"].contains(&got["chat_finish"].as_str().unwrap_or("")));
    assert_eq!(got["refused"], 400);

    // --max-connections 1: while one request is being read (its body half sent), another
    // gets 429 in OpenAI's shape; once that client is gone the server serves again.
    {
        let mut held = TcpStream::connect(server.addr).unwrap();
        write!(
            held,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
        )
        .unwrap();
        // The window only bounds a server that never answers 429: on a loaded 2-core
        // machine the held connection's task may run late (CI once saw no 429 in 10 s).
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = std::collections::BTreeMap::<u16, usize>::new();
        loop {
            let busy = request(server.addr, "GET", "/health", &[], b"");
            if busy.status == 429 {
                assert!(busy.json()["error"]["message"].is_string(), "{}", busy.body);
                break;
            }
            *seen.entry(busy.status).or_default() += 1;
            if Instant::now() >= deadline {
                // What the server said to the held request, if anything: an answer there
                // means it stopped holding the slot.
                held.set_nonblocking(true).unwrap();
                let mut answer = Vec::new();
                let _ = held.read_to_end(&mut answer);
                panic!(
                    "no 429 while a request is held: /health answered {seen:?}; the held request got {:?}",
                    String::from_utf8_lossy(&answer)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while request(server.addr, "GET", "/health", &[], b"").status != 200 {
        assert!(Instant::now() < deadline, "the server did not serve again");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A schedule of static batches (`cgopipe`: `prefill` + `decode`, a prefill that writes
/// its own cache lines, so no chunked prefill and no joining a running batch) about to
/// start a batch with room waits up to `--batch-wait-ms` for more requests: a second request sent 300 ms
/// after the first (well inside a 20 s window) joins the first one's batch, so the server
/// runs one batch of 4 steps (1 prefill + 3 decode for 4 tokens), not two; with
/// `--batch-wait-ms 0` and the second request sent once the first has ended, two batches
/// (8 steps). The count of steps is the server's own `/metrics`, not a timing.
#[test]
fn a_static_batch_waits_for_requests_that_arrive_within_batch_wait() {
    let body = |p: &str| serde_json::json!({"prompt": p, "max_tokens": 4, "temperature": 0});
    for (wait, steps) in [("20000", 4.0), ("0", 8.0)] {
        let server = serve(
            "schedules/cgopipe.sched",
            &[
                "--max-batch",
                "2",
                "--max-prompt",
                "16",
                "--max-tokens",
                "4",
                "--batch-wait-ms",
                wait,
            ],
        );
        let addr = server.addr;
        let mut first = Some(std::thread::spawn(move || {
            post(addr, "/v1/completions", &body("Hello"), None)
        }));
        let mut join_first = || {
            let reply = first.take().expect("joined once").join().expect("no panic");
            assert_eq!(reply.status, 200, "{}", reply.body);
        };
        if wait == "0" {
            join_first();
        } else {
            std::thread::sleep(Duration::from_millis(300));
        }
        let second = post(addr, "/v1/completions", &body("Once upon a time"), None);
        assert_eq!(second.status, 200, "{}", second.body);
        if wait != "0" {
            join_first();
        }
        assert_eq!(
            metric(addr, "moec_steps_total", None),
            steps,
            "--batch-wait-ms {wait}"
        );
    }
}

/// A `prefill` + `decode` schedule whose prefill attends its KV cache (`resident`) admits
/// a request while another decodes, and a pass shared by several sequences prefills at
/// most `--prefill-budget` prompt tokens: the second request (a prompt of 16 tokens, so four passes of 4) is sent once
/// the first streams, gets its first text before the first's last, and the passes that
/// prefill it also carry the first's next tokens (the server's `MOEC_SERVE_TRACE`: a step
/// with prompt tokens that hands out a token which is not a first one). Both texts equal
/// `moec run` of their prompts (which runs them in static batches): a decoding
/// sequence's token run as a one-token chunk of the prefill step is the decode step's.
#[test]
fn resident_admits_while_decoding_within_the_prefill_budget() {
    let sched = "schedules/baselines/resident.sched";
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let server = serve_with_env(
        sched,
        &[
            "--max-batch",
            "2",
            "--max-prompt",
            "16",
            "--max-tokens",
            "40",
            "--prefill-budget",
            "4",
            "--set",
            "ubs=2",
            "--set",
            "n_ub=1",
        ],
        &[("MOEC_SERVE_TRACE", trace.as_path())],
    );
    let addr = server.addr;
    // The first prompt arrives alone, and a lone prompt is not capped by the budget: it
    // is kept within the budget (3 tokens with BOS) so that every pass of the trace is.
    let (long_prompt, short_prompt) = (
        "Once upon",
        "The quick brown fox jumps over the lazy dog near the river bank",
    );
    let long = serde_json::json!({"prompt": long_prompt, "max_tokens": 40, "temperature": 0, "stream": true});
    let short = serde_json::json!({"prompt": short_prompt, "max_tokens": 4, "temperature": 0, "stream": true});
    let ((short_text, first_of_second), (long_text, last_of_first)) = std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let a = s.spawn(move || {
            let mut last = None;
            let mut told = false;
            let (text, _) = stream(addr, &long, None, |_, at| {
                last = Some(at);
                if !told {
                    told = true;
                    let _ = tx.send(());
                }
            });
            (text, last.expect("the long request produced text"))
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the long request started");
        let b = s.spawn(move || {
            let mut first = None;
            let (text, _) = stream(addr, &short, None, |_, at| {
                first.get_or_insert(at);
            });
            (text, first.expect("the short request produced text"))
        });
        (b.join().unwrap(), a.join().unwrap())
    });
    assert!(
        first_of_second < last_of_first,
        "the second request waited for the first to finish"
    );
    drop(server);
    let steps: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
        .expect("the trace")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .filter(|l: &serde_json::Value| l.get("start").is_some())
        .collect();
    let prefill = |l: &serde_json::Value| l["prefill_tokens"].as_u64().expect("prefill_tokens");
    assert!(
        steps.iter().all(|l| prefill(l) <= 4),
        "a pass prefilled more than the budget: {steps:?}"
    );
    let mixed = steps.iter().filter(|l| {
        let firsts = l["first"].as_array().map_or(0, Vec::len) as u64;
        prefill(l) > 0 && l["tokens"].as_u64().unwrap_or(0) > firsts
    });
    assert!(
        mixed.count() >= 3,
        "the short prompt's passes did not carry the long one's tokens: {steps:?}"
    );
    assert_eq!(long_text, run_text(sched, long_prompt, 40));
    assert_eq!(short_text, run_text(sched, short_prompt, 4));
}

/// The long-context card of these tests: mixtral-tiny with a 4k context. (The tiny cards'
/// 32k configuration, `mixtral-tiny-32k.ron`, is what `tests/model_oracle.rs` and
/// `scripts/long-context.sh` run; a 32k prompt takes minutes in a debug build.)
const LONG_CARD: &str = "tests/fixtures/longctx/mixtral-tiny-4k.ron";

/// `moec run`'s greedy continuations of `prompts` (`gen` tokens each), one process.
fn run_texts(sched: &str, model: &str, prompts: &[String], gen: usize) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let out = moec()
        .args(["run", sched, "--json", "--hw", "t4", "--model", model])
        .args(["--gen-len", &gen.to_string(), "--prompts"])
        .arg(&file)
        .output()
        .expect("moec run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let outputs = doc["outputs"].as_array().expect("outputs");
    assert_eq!(outputs.len(), prompts.len());
    outputs
        .iter()
        .map(|o| o["text"].as_str().expect("a text").to_string())
        .collect()
}

/// Issue 46's multi-turn chat on a card with a long context: 8 clients x 6 turns, each
/// turn adding a user message of ~480 tokens to the client's whole history, so the last
/// prompts hold ~3,000 tokens, served by a plan compiled for passes of 8 x 256 prompt
/// tokens (longer prompts are prefilled in chunks). The second and the last turn's greedy
/// texts equal `moec run` of their full prompts; from the second turn on every client's history comes from the
/// prefix cache; the peak of KV blocks in use (from `/metrics`) stays below what reserving
/// each sequence's whole context would have taken; no sequence is preempted. Then the
/// context limit (the card's 4,096 positions): a prompt of 4,095 tokens with one to
/// generate is served, one of 4,096 gets OpenAI's error body.
#[test]
fn multi_turn_chats_reuse_their_prefix_and_match_moec_run() {
    let sched = "schedules/baselines/resident.sched";
    let (clients, turns, max_tokens) = (8, 6, 6);
    let server = serve(
        sched,
        &[
            "--model",
            LONG_CARD,
            "--max-batch",
            "8",
            "--max-prompt",
            "256",
            "--max-tokens",
            &max_tokens.to_string(),
        ],
    );
    let addr = server.addr;
    let models = request(addr, "GET", "/v1/models", &[], b"").json();
    assert_eq!(models["data"][0]["prefix_cache"], true);
    assert_eq!(models["data"][0]["context_tokens"], 4096);
    let system = "You are a helpful assistant who answers briefly and well. ".repeat(3);
    let topic = |c: usize, t: usize| {
        format!(
            "Question {t} from reader {c}: {}",
            "Tell me how rivers shape the valleys they run through, and why some of them meander across wide plains while others cut deep gorges into the rock. "
                .repeat(16)
        )
    };
    let mut history: Vec<String> = vec![system.clone(); clients];
    let mut served: Vec<(String, String)> = Vec::new();
    let mut last_prompt_tokens = vec![0u64; clients];
    let mut hits_before = 0.0;
    for turn in 0..turns {
        let prompts: Vec<String> = history
            .iter()
            .enumerate()
            .map(|(c, h)| format!("{h}User: {}\nAssistant:", topic(c, turn)))
            .collect();
        let replies: Vec<serde_json::Value> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| {
                    s.spawn(move || {
                        let body = serde_json::json!({"prompt": p, "max_tokens": max_tokens, "temperature": 0});
                        let reply = post(addr, "/v1/completions", &body, None);
                        assert_eq!(reply.status, 200, "{}", reply.body);
                        reply.json()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (c, reply) in replies.iter().enumerate() {
            let text = reply["choices"][0]["text"]
                .as_str()
                .expect("text")
                .to_string();
            last_prompt_tokens[c] = reply["usage"]["prompt_tokens"].as_u64().expect("usage");
            history[c] = format!("{}{text}\n", prompts[c]);
            served.push((prompts[c].clone(), text));
        }
        let m = scrape(addr, None);
        let hits = sample(&m, "moec_prefix_cache_hits_total", &[]);
        if turn > 0 {
            assert!(
                hits - hits_before >= clients as f64,
                "turn {turn}: {hits_before} -> {hits} prefix hits"
            );
        }
        hits_before = hits;
    }
    let longest = *last_prompt_tokens.iter().max().unwrap();
    assert!(
        (2800..4000).contains(&longest),
        "the last turn holds {longest} tokens"
    );
    let m = scrape(addr, None);
    assert!(sample(&m, "moec_prefix_cache_hit_tokens_total", &[]) > 0.0);
    assert_eq!(sample(&m, "moec_preemptions_total", &[]), 0.0);
    let block = sample(&m, "moec_kv_block_tokens", &[]) as u64;
    assert!(block > 0);
    let reserved: u64 = last_prompt_tokens
        .iter()
        .map(|t| (t + max_tokens as u64).div_ceil(block))
        .sum();
    let peak = sample(&m, "moec_kv_blocks_used_peak", &[]) as u64;
    eprintln!(
        "{clients} clients x {turns} turns, last prompts up to {longest} tokens: {} of {} admitted tokens from the prefix cache; peak {peak} KV blocks of {block} tokens in use, reserving each last prompt and its max_tokens would take {reserved}, the whole context {}",
        sample(&m, "moec_prefix_cache_hit_tokens_total", &[]),
        sample(&m, "moec_prefix_cache_queried_tokens_total", &[]),
        clients as u64 * 4096u64.div_ceil(block)
    );
    assert!(
        peak < reserved,
        "peak {peak} blocks, reservation {reserved}"
    );

    // The second turn (the first whose history comes from the prefix cache) and the last
    // (each client's whole history, every block of it reused from earlier turns) equal
    // `moec run` of their whole prompts. `moec run` has no prefix cache, so re-running all
    // six turns prefilled ~84k tokens, three quarters of this test's time; these two turns
    // are ~32k of them.
    let checked: Vec<&(String, String)> = served
        .iter()
        .enumerate()
        .filter(|(i, _)| [1, turns - 1].contains(&(i / clients)))
        .map(|(_, s)| s)
        .collect();
    let prompts: Vec<String> = checked.iter().map(|(p, _)| p.clone()).collect();
    let expected = run_texts(sched, LONG_CARD, &prompts, max_tokens);
    for ((prompt, got), want) in checked.iter().map(|s| (&s.0, &s.1)).zip(&expected) {
        assert_eq!(got, want, "prompt of {} chars", prompt.len());
    }

    // The context limit: the refusal says how many tokens a prompt has, so the prompt of
    // exactly the limit is found without running one.
    let limit = 4096u64;
    let ask = |words: usize| {
        let body =
            serde_json::json!({"prompt": "one ".repeat(words), "max_tokens": 1, "temperature": 0});
        post(addr, "/v1/completions", &body, None)
    };
    let counted = |reply: &Reply| -> u64 {
        assert_eq!(reply.status, 400, "{}", reply.body);
        let doc = reply.json();
        assert_eq!(doc["error"]["type"], "invalid_request_error");
        assert_eq!(doc["error"]["param"], "prompt");
        doc["error"]["message"]
            .as_str()
            .and_then(|m| m.strip_prefix("the prompt has "))
            .and_then(|m| m.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{}", reply.body))
    };
    // Each "one " is a token: count a prompt past the limit, then take off what is over.
    let mut words = limit as usize + 100;
    let mut n = counted(&ask(words));
    for _ in 0..5 {
        if n == limit {
            break;
        }
        assert!(n > limit, "{words} words gave {n} tokens");
        words -= (n - limit) as usize;
        n = counted(&ask(words));
    }
    assert_eq!(
        n, limit,
        "no prompt of {limit} tokens found near {words} words"
    );
    let at_limit = ask(words - 1);
    assert_eq!(at_limit.status, 200, "{}", at_limit.body);
    assert_eq!(at_limit.json()["usage"]["prompt_tokens"], limit - 1);
}

/// An SSE stream through a proxy that re-chunks it: the body de-chunked as it arrives;
/// `on_first` is called once the first text has come. Returns the text and whether the
/// stream ended with `data: [DONE]` (a stream whose server died ends without it).
fn stream_chunked(
    addr: SocketAddr,
    body: &serde_json::Value,
    on_first: impl FnOnce(),
) -> (String, bool) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains(" 200 "), "status line {line:?}");
    let mut chunked = false;
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        chunked |= line
            .to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked");
    }
    let (mut data, mut text, mut done) = (Vec::new(), String::new(), false);
    let mut on_first = Some(on_first);
    loop {
        if chunked {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                break;
            }
            let Ok(size) = usize::from_str_radix(line.trim(), 16) else {
                break;
            };
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size + 2];
            if reader.read_exact(&mut chunk).is_err() {
                break;
            }
            data.extend_from_slice(&chunk[..size]);
        } else {
            let mut buf = [0u8; 4096];
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => data.extend_from_slice(&buf[..n]),
            }
        }
        while let Some(end) = data.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = data.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            let Some(payload) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if payload == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: serde_json::Value = serde_json::from_str(payload).expect("a JSON chunk");
            if let Some(t) = chunk["choices"][0]["text"]
                .as_str()
                .filter(|t| !t.is_empty())
            {
                text.push_str(t);
                if let Some(f) = on_first.take() {
                    f();
                }
            }
        }
    }
    (text, done)
}

/// `scripts/ray_serve.py`: two `moec serve` replicas as Ray actors behind its router. A
/// stream on replica 0 is cut when that replica's moec is killed mid-stream, while the
/// stream on replica 1 completes; the requests sent right after the kill are all answered
/// (the router sends one whose replica refuses to the other), Ray restarts the killed
/// replica (a new moec process), and it serves again. Skipped without Ray unless
/// `MOEC_REQUIRE_RAY` is set (`.ci/run` sets it).
#[test]
fn ray_serve_replicas_survive_a_killed_replica() {
    let python = std::env::var("MOEC_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_ray = Command::new(&python)
        .args(["-c", "import ray"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_ray {
        assert!(
            std::env::var_os("MOEC_REQUIRE_RAY").is_none(),
            "MOEC_REQUIRE_RAY is set but `{python} -c 'import ray'` fails"
        );
        eprintln!("skipped: no `ray` for {python} (set MOEC_PYTHON, or run .ci/run)");
        return;
    }
    let mut child = Command::new(&python)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache())
        .env_remove("MOEC_API_KEY")
        .arg("scripts/ray_serve.py")
        .args(["--replicas", "2", "--num-cpus", "2", "--port", "0"])
        .args(["--health-interval", "0.5"])
        .args(["--moec", env!("CARGO_BIN_EXE_moec"), "--"])
        .args([
            "schedules/baselines/resident.sched",
            "--hw",
            "t4",
            "--threads",
            "1",
        ])
        .args([
            "--max-batch",
            "4",
            "--max-prompt",
            "32",
            "--max-tokens",
            "400",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 scripts/ray_serve.py starts");
    // Stops the router (and with it Ray and the replicas) however the test ends.
    struct Router(Child);
    impl Drop for Router {
        fn drop(&mut self) {
            // SAFETY: kill(2) on the router's own pid, a plain syscall.
            unsafe {
                libc::kill(self.0.id() as i32, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.0.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().expect("piped stdout");
    let router = Router(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("the router says where it listens");
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
        .parse()
        .expect("an address");
    let replicas = || request(addr, "GET", "/replicas", &[], b"").json()["replicas"].clone();
    let first = replicas();
    let pid0 = first[0]["pid"].as_i64().expect("replica 0's pid");
    assert!(first[1]["pid"].as_i64().is_some());

    let long = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": true});
    let short = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (cut, whole, after) = std::thread::scope(|s| {
        // The router takes replicas in turn: the first stream goes to replica 0.
        let tx = started_tx.clone();
        let on_0 = s.spawn(|| stream_chunked(addr, &long, move || tx.send(()).unwrap()));
        started_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("stream 0 started");
        let tx = started_tx.clone();
        let on_1 = s.spawn(|| stream_chunked(addr, &long, move || tx.send(()).unwrap()));
        started_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("stream 1 started");
        // SAFETY: kill(2) on replica 0's moec process, which this test's router started.
        assert_eq!(unsafe { libc::kill(pid0 as i32, libc::SIGKILL) }, 0);
        let after: Vec<Reply> = (0..4)
            .map(|_| post(addr, "/v1/completions", &short, None))
            .collect();
        (on_0.join().unwrap(), on_1.join().unwrap(), after)
    });
    assert!(
        !cut.1,
        "the stream on the killed replica ended with [DONE]: {}",
        cut.0
    );
    assert!(whole.1, "the stream on the other replica was cut");
    assert!(!whole.0.is_empty());
    for reply in &after {
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert!(reply.json()["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    }
    // Ray restarts replica 0 (a new moec process) and the router takes it back.
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let now = replicas();
        let back = now[0]["healthy"] == true && now[0]["pid"].as_i64() != Some(pid0);
        if back {
            assert_eq!(now[0]["restarts"], 1);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica 0 did not come back: {now}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let texts: Vec<String> = (0..4)
        .map(|_| {
            let reply = post(addr, "/v1/completions", &short, None);
            assert_eq!(reply.status, 200, "{}", reply.body);
            reply.json()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    // Both replicas (the restarted one included) answer the same greedy text.
    assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
    let first_answer = after[0].json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(texts[0], first_answer);
    drop(router);
}

/// `response_format`: 20 completions (greedy and sampled, several prompts) under a JSON
/// schema all parse and hold to it (checked here field by field, and by Python's
/// `jsonschema` where it is installed); `json_object` gives an object; a schema
/// llguidance cannot use is a 400 naming `response_format`.
#[test]
fn response_format_json_schema_holds_every_output_to_the_schema() {
    let server = serve(
        "schedules/baselines/resident.sched",
        &[
            "--max-batch",
            "4",
            "--max-prompt",
            "64",
            "--max-tokens",
            "96",
        ],
    );
    let addr = server.addr;
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "colour": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "colour", "ok"],
        "additionalProperties": false
    });
    let format = serde_json::json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}});
    let prompts = [
        "A person:",
        "Describe someone as JSON.",
        "Once upon a time",
        "{",
    ];
    let outputs: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..20)
            .map(|i| {
                let format = format.clone();
                s.spawn(move || {
                    let (temperature, seed) = if i < 10 { (0.0, 0) } else { (1.0, i) };
                    let body = serde_json::json!({
                        "prompt": prompts[i % prompts.len()], "max_tokens": 96,
                        "temperature": temperature, "seed": seed, "response_format": format,
                    });
                    let reply = post(addr, "/v1/completions", &body, None);
                    assert_eq!(reply.status, 200, "{}", reply.body);
                    let doc = reply.json();
                    assert_eq!(doc["choices"][0]["finish_reason"], "stop", "{}", reply.body);
                    doc["choices"][0]["text"].as_str().unwrap().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for text in &outputs {
        let v: serde_json::Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let o = v
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {text}"));
        assert_eq!(o.len(), 4, "{text}");
        assert!(
            o["name"].as_str().is_some_and(|n| n.chars().count() <= 8),
            "{text}"
        );
        assert!(o["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
        assert!(
            ["red", "green", "blue"].contains(&o["colour"].as_str().unwrap_or("")),
            "{text}"
        );
        assert!(o["ok"].is_boolean(), "{text}");
    }
    let python = std::env::var("MOEC_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_jsonschema = Command::new(&python)
        .args(["-c", "import jsonschema"])
        .output()
        .is_ok_and(|o| o.status.success());
    if has_jsonschema {
        let check = "import json, sys, jsonschema\nd = json.load(sys.stdin)\nfor t in d['outputs']:\n    jsonschema.validate(json.loads(t), d['schema'])\nprint(len(d['outputs']))";
        let mut child = Command::new(&python)
            .args(["-c", check])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let input = serde_json::json!({"schema": schema, "outputs": outputs}).to_string();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "jsonschema refused an output");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "20");
    } else {
        eprintln!("no `jsonschema` for {python}: validated field by field only");
    }

    let object = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "{", "max_tokens": 96, "temperature": 0, "response_format": {"type": "json_object"}}),
        None,
    );
    assert_eq!(object.status, 200, "{}", object.body);
    let doc = object.json();
    if doc["choices"][0]["finish_reason"] == "stop" {
        let text = doc["choices"][0]["text"].as_str().unwrap();
        let v: serde_json::Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(v.is_object(), "{text}");
    }

    let bad = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}),
        None,
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(
        bad.json()["error"]["param"],
        "response_format",
        "{}",
        bad.body
    );
    let missing = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
        None,
    );
    assert_eq!(missing.status, 400, "{}", missing.body);
}

/// Tool calls: with `tool_choice` `"required"` or a named function, every call (greedy
/// and sampled, whole and streamed through the real `openai` client) names a listed tool
/// (the named one when named) and its arguments parse and hold to that tool's parameters
/// schema (field by field, and by Python's `jsonschema` where installed); a history with
/// an assistant's `tool_calls` and a `tool` message renders; `"none"` is plain text;
/// `"auto"` (explicit or by default) is such a call or text that does not open with `{`;
/// a tool without a name, a parameters schema llguidance refuses and a named function
/// not in `tools` are 400s in OpenAI's shape.
#[test]
fn tool_calls_name_a_listed_tool_with_arguments_valid_under_its_schema() {
    let dir = tempfile::tempdir().unwrap();
    let weights = chat_checkpoint(dir.path());
    let server = serve(
        "schedules/baselines/resident.sched",
        &[
            "--weights",
            weights.to_str().unwrap(),
            "--max-batch",
            "4",
            "--max-prompt",
            "512",
            "--max-tokens",
            "128",
        ],
    );
    let addr = server.addr;
    let weather = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["c", "f"]}
        },
        "required": ["city", "unit"],
        "additionalProperties": false
    });
    let add = serde_json::json!({
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99}
        },
        "required": ["a", "b"],
        "additionalProperties": false
    });
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": weather}},
        {"type": "function", "function": {"name": "add", "description": "Adds two numbers.", "parameters": add}}
    ]);
    let named_add = serde_json::json!({"type": "function", "function": {"name": "add"}});
    let user = serde_json::json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    // (name, arguments, the name it had to be if one)
    let mut calls: Vec<(String, String, Option<&str>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8u64)
            .map(|i| {
                let (tools, named_add, user) = (&tools, &named_add, &user);
                s.spawn(move || {
                    let temperature = if i < 4 { 0.0 } else { 1.0 };
                    let (choice, must) = if i % 2 == 0 {
                        (serde_json::json!("required"), None)
                    } else {
                        (named_add.clone(), Some("add"))
                    };
                    let body = serde_json::json!({
                        "messages": user, "tools": tools, "tool_choice": choice,
                        "max_tokens": 128, "temperature": temperature, "seed": i,
                    });
                    let reply = post(addr, "/v1/chat/completions", &body, None);
                    assert_eq!(reply.status, 200, "{}", reply.body);
                    let doc = reply.json();
                    let choice = &doc["choices"][0];
                    assert_eq!(choice["finish_reason"], "tool_calls", "{}", reply.body);
                    assert!(choice["message"]["content"].is_null(), "{}", reply.body);
                    let list = choice["message"]["tool_calls"].as_array().unwrap();
                    assert_eq!(list.len(), 1, "{}", reply.body);
                    let call = &list[0];
                    assert!(
                        call["id"]
                            .as_str()
                            .is_some_and(|id| id.starts_with("call_")),
                        "{}",
                        reply.body
                    );
                    assert_eq!(call["type"], "function", "{}", reply.body);
                    (
                        call["function"]["name"].as_str().unwrap().to_string(),
                        call["function"]["arguments"].as_str().unwrap().to_string(),
                        must,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    // Streamed (and one whole) through the real client, which assembles the deltas.
    if let Some(pythonpath) = openai_python() {
        let script = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
d = json.loads(sys.argv[2])
out = []
for i, choice in enumerate(d["choices"]):
    name, args, ids, finish, content, pieces = None, "", [], None, None, 0
    for ch in client.chat.completions.create(model="m", messages=d["messages"], tools=d["tools"],
            tool_choice=choice, max_tokens=128, temperature=0 if i < 2 else 1, seed=i, stream=True):
        if not ch.choices:
            continue
        c = ch.choices[0]
        if c.delta.content:
            content = (content or "") + c.delta.content
        for tc in c.delta.tool_calls or []:
            if tc.id:
                ids.append(tc.id)
            if tc.function and tc.function.name:
                name = tc.function.name
            if tc.function and tc.function.arguments:
                args += tc.function.arguments
                pieces += 1
        if c.finish_reason:
            finish = c.finish_reason
    out.append({"name": name, "arguments": args, "ids": ids, "finish": finish, "content": content, "pieces": pieces})
r = client.chat.completions.create(model="m", messages=d["messages"], tools=d["tools"],
        tool_choice="required", max_tokens=128, temperature=0)
m = r.choices[0].message
out.append({"name": m.tool_calls[0].function.name, "arguments": m.tool_calls[0].function.arguments,
            "ids": [m.tool_calls[0].id], "finish": r.choices[0].finish_reason, "content": m.content})
print(json.dumps(out))
"#;
        let input = serde_json::json!({
            "messages": user, "tools": tools,
            "choices": ["required", named_add, "required", named_add, "auto"],
        });
        let mut python = Command::new("python3");
        python.args([
            "-c",
            script,
            &format!("http://{addr}/v1"),
            &input.to_string(),
        ]);
        if let Some(p) = &pythonpath {
            python.env("PYTHONPATH", p);
        }
        let out = python.output().expect("python3 runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("the script's JSON");
        for (i, call) in got.as_array().unwrap().iter().enumerate() {
            if i == 4 && call["finish"] != "tool_calls" {
                // "auto" streamed text: no call, and text a call would not be.
                let text = call["content"].as_str().unwrap_or("");
                assert!(!text.starts_with('{'), "{call}");
                assert!(call["ids"].as_array().unwrap().is_empty(), "{call}");
                continue;
            }
            assert_eq!(call["finish"], "tool_calls", "{call}");
            assert!(call["content"].is_null(), "{call}");
            let ids = call["ids"].as_array().unwrap();
            assert_eq!(ids.len(), 1, "one id per call: {call}");
            assert!(ids[0].as_str().unwrap().starts_with("call_"), "{call}");
            if i < 4 {
                // The arguments stream as they are written, not in one piece at the end.
                assert!(call["pieces"].as_u64().unwrap() > 1, "{call}");
            }
            let must = (i % 2 == 1 && i < 4).then_some("add");
            calls.push((
                call["name"].as_str().unwrap().to_string(),
                call["arguments"].as_str().unwrap().to_string(),
                must,
            ));
        }
    }

    // "auto", explicit and by default: a call (checked with the others below), or text
    // that does not open with `{`, or a call `max_tokens` cut (its text, `length`).
    let mut auto = [0usize; 3];
    for i in 0..6u64 {
        let mut body = serde_json::json!({
            "messages": user, "tools": tools, "max_tokens": 128,
            "temperature": if i < 2 { 0.0 } else { 1.0 }, "seed": i,
        });
        if i % 2 == 0 {
            body["tool_choice"] = serde_json::json!("auto");
        }
        let reply = post(addr, "/v1/chat/completions", &body, None);
        assert_eq!(reply.status, 200, "{}", reply.body);
        let doc = reply.json();
        let choice = &doc["choices"][0];
        let message = &choice["message"];
        if choice["finish_reason"] == "tool_calls" {
            let call = &message["tool_calls"][0];
            assert!(message["content"].is_null(), "{}", reply.body);
            calls.push((
                call["function"]["name"].as_str().unwrap().to_string(),
                call["function"]["arguments"].as_str().unwrap().to_string(),
                None,
            ));
            auto[0] += 1;
        } else {
            assert!(message["tool_calls"].is_null(), "{}", reply.body);
            let text = message["content"].as_str().unwrap();
            if text.starts_with('{') {
                assert_eq!(choice["finish_reason"], "length", "{}", reply.body);
                auto[2] += 1;
            } else {
                auto[1] += 1;
            }
        }
    }
    eprintln!(
        "tool_choice auto: {} calls, {} texts, {} calls cut by max_tokens",
        auto[0], auto[1], auto[2]
    );

    let mut checked = Vec::new();
    for (name, arguments, must) in &calls {
        if let Some(must) = must {
            assert_eq!(name, must);
        }
        let args: serde_json::Value =
            serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments:?}"));
        let o = args.as_object().unwrap();
        match name.as_str() {
            "get_weather" => {
                assert_eq!(o.len(), 2, "{arguments}");
                assert!(
                    o["city"].as_str().is_some_and(|c| c.chars().count() <= 8),
                    "{arguments}"
                );
                assert!(
                    ["c", "f"].contains(&o["unit"].as_str().unwrap_or("")),
                    "{arguments}"
                );
                checked.push(serde_json::json!({"schema": weather, "arguments": args}));
            }
            "add" => {
                assert_eq!(o.len(), 2, "{arguments}");
                assert!(o["a"].as_u64().is_some_and(|a| a <= 99), "{arguments}");
                assert!(o["b"].as_u64().is_some_and(|b| b <= 99), "{arguments}");
                checked.push(serde_json::json!({"schema": add, "arguments": args}));
            }
            other => panic!("a call of `{other}`, which is not a listed tool"),
        }
    }
    let python = std::env::var("MOEC_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_jsonschema = Command::new(&python)
        .args(["-c", "import jsonschema"])
        .output()
        .is_ok_and(|o| o.status.success());
    if has_jsonschema {
        let check = "import json, sys, jsonschema\nd = json.load(sys.stdin)\nfor c in d:\n    jsonschema.validate(c['arguments'], c['schema'])\nprint(len(d))";
        let mut child = Command::new(&python)
            .args(["-c", check])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let input = serde_json::Value::Array(checked.clone()).to_string();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "jsonschema refused a call's arguments"
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            checked.len().to_string()
        );
    } else {
        eprintln!("no `jsonschema` for {python}: validated field by field only");
    }

    // A history with an earlier call and its result renders; "none" is plain text.
    let history = serde_json::json!([
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "5"}
    ]);
    for choice in [serde_json::json!("required"), serde_json::json!("none")] {
        let body = serde_json::json!({"messages": history, "tools": tools, "tool_choice": choice, "max_tokens": 8, "temperature": 0});
        let reply = post(addr, "/v1/chat/completions", &body, None);
        assert_eq!(reply.status, 200, "{}", reply.body);
        if choice == "none" {
            let doc = reply.json();
            assert!(
                doc["choices"][0]["message"]["content"].is_string(),
                "{}",
                reply.body
            );
            assert!(
                doc["choices"][0]["message"]["tool_calls"].is_null(),
                "{}",
                reply.body
            );
        }
    }

    let bad = |body: serde_json::Value, param: &str| {
        let reply = post(addr, "/v1/chat/completions", &body, None);
        assert_eq!(reply.status, 400, "{body}: {}", reply.body);
        let doc = reply.json();
        assert_eq!(
            doc["error"]["type"], "invalid_request_error",
            "{}",
            reply.body
        );
        assert_eq!(doc["error"]["param"], param, "{}", reply.body);
        doc["error"]["message"].as_str().unwrap().to_string()
    };
    bad(
        serde_json::json!({"messages": user, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"parameters": weather}}]}),
        "tools",
    );
    bad(
        serde_json::json!({"messages": user, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]}),
        "tools",
    );
    let unknown = bad(
        serde_json::json!({"messages": user, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        "tool_choice",
    );
    assert!(unknown.contains("nope"), "{unknown}");
    bad(
        serde_json::json!({"messages": user, "tools": tools, "tool_choice": "sometimes"}),
        "tool_choice",
    );
    bad(
        serde_json::json!({"messages": user, "tool_choice": "required"}),
        "tool_choice",
    );
    bad(
        serde_json::json!({"messages": user, "tools": tools, "tool_choice": "required",
            "response_format": {"type": "json_object"}}),
        "response_format",
    );
    // The server still serves after every refusal.
    let ok = post(
        addr,
        "/v1/chat/completions",
        &serde_json::json!({"messages": user, "tools": tools, "tool_choice": named_add, "max_tokens": 128, "temperature": 0}),
        None,
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
}
