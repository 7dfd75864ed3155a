//! The protocol loop: JSON-RPC messages in, responses and notifications out, one at a
//! time on the calling thread.
//!
//! Framing is read here rather than by `lsp_server`'s reader, so that a bad message is
//! answered and skipped instead of ending the session: a body that is not JSON gets a
//! `ParseError` response, JSON that is not a message an `InvalidRequest`, a body longer
//! than [`MAX_MESSAGE_BYTES`] is skipped unread and refused, an unknown request a
//! `MethodNotFound`, and a request whose params do not fit its method an `InvalidParams`.
//! Unknown notifications are logged and dropped. Only a broken transport (the input ends
//! or cannot be read, the output cannot be written) ends the loop early, with an error.

use super::documents::{Document, Documents};
use super::positions::LineIndex;
use super::settings::{CardLoader, Settings, Setup};
use super::{completion, definition, hover};
use crate::diag::{self, Severity};
use lsp_server::{ErrorCode, Message, Notification, Request, RequestId, Response};
use lsp_types::{
    CompletionOptions, CompletionParams, CompletionResponse, DiagnosticRelatedInformation,
    DiagnosticSeverity, DidChangeTextDocumentParams, DidCloseTextDocumentParams,
    DidOpenTextDocumentParams, DidSaveTextDocumentParams, GotoDefinitionParams,
    GotoDefinitionResponse, Hover, HoverContents, HoverParams, HoverProviderCapability,
    InitializeParams, InitializeResult, Location, MarkupContent, MarkupKind, MessageType,
    NumberOrString, OneOf, Position, PublishDiagnosticsParams, Range, ServerCapabilities,
    ServerInfo, ShowMessageParams, TextDocumentSyncCapability, TextDocumentSyncKind,
    TextDocumentSyncOptions, TextDocumentSyncSaveOptions, Uri,
};
use serde::de::DeserializeOwned;
use std::io::{BufRead, Read, Write};

/// The longest message body read (a schedule is capped at 64 MiB; its JSON escaping
/// may grow it a little).
pub const MAX_MESSAGE_BYTES: usize = 80 << 20;

/// How the session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// `shutdown` then `exit`: exit code 0.
    Clean,
    /// `exit` without `shutdown`, or the input ended first: exit code 1 (the protocol's rule).
    Abrupt,
}

/// Serves one session: reads messages from `input`, writes to `output`, logs to `log`.
/// `Err` only when the transport breaks (reading or writing fails).
pub fn serve(
    input: &mut dyn BufRead,
    output: &mut dyn Write,
    log: &mut dyn Write,
    load_card: CardLoader,
) -> std::io::Result<Ending> {
    let mut server = Server {
        output,
        log,
        load_card,
        setup: None,
        documents: Documents::default(),
        shutdown: false,
    };
    loop {
        let message = match read_message(input)? {
            Framed::End => {
                server.note("the input ended before `exit`");
                return Ok(Ending::Abrupt);
            }
            Framed::Bad(code, why) => {
                server.note(&format!("refused a message: {why}"));
                server.send_error(None, code, why)?;
                continue;
            }
            Framed::Message(message) => message,
        };
        match message {
            Message::Request(request) => server.request(request)?,
            Message::Notification(n) if n.method == "exit" => {
                return Ok(if server.shutdown {
                    Ending::Clean
                } else {
                    Ending::Abrupt
                });
            }
            Message::Notification(n) => server.notification(n)?,
            Message::Response(r) => server.note(&format!(
                "ignored a response (id {}): this server sends no requests",
                r.id
            )),
        }
    }
}

/// One read from the input.
enum Framed {
    Message(Message),
    /// A bad message, already consumed: the error code and why.
    Bad(ErrorCode, String),
    End,
}

/// Reads one `Content-Length`-framed message.
fn read_message(input: &mut dyn BufRead) -> std::io::Result<Framed> {
    let mut length: Option<Result<usize, String>> = None;
    let mut saw_header = false;
    loop {
        let mut line = Vec::new();
        // A header line is short; a longer one is not a header (bounded read).
        let n = input.take(4096).read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(Framed::End);
        }
        let line = String::from_utf8_lossy(&line);
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            if saw_header {
                break;
            }
            continue;
        }
        saw_header = true;
        if let Some((name, value)) = line.split_once(':') {
            if name.trim().eq_ignore_ascii_case("Content-Length") {
                length = Some(
                    value
                        .trim()
                        .parse::<usize>()
                        .map_err(|_| format!("bad Content-Length `{}`", value.trim())),
                );
            }
        }
    }
    let length = match length {
        None => {
            return Ok(Framed::Bad(
                ErrorCode::ParseError,
                "a message without Content-Length".to_string(),
            ))
        }
        Some(Err(why)) => return Ok(Framed::Bad(ErrorCode::ParseError, why)),
        Some(Ok(length)) => length,
    };
    if length > MAX_MESSAGE_BYTES {
        let skipped = std::io::copy(&mut input.take(length as u64), &mut std::io::sink())?;
        if skipped < length as u64 {
            return Ok(Framed::End);
        }
        return Ok(Framed::Bad(
            ErrorCode::InvalidRequest,
            format!("a message of {length} bytes; at most {MAX_MESSAGE_BYTES} are read"),
        ));
    }
    let mut body = vec![0; length];
    if let Err(e) = input.read_exact(&mut body) {
        return match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Ok(Framed::End),
            _ => Err(e),
        };
    }
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(e) => return Ok(Framed::Bad(ErrorCode::ParseError, format!("not JSON: {e}"))),
    };
    match serde_json::from_value::<Message>(value) {
        Ok(message) => Ok(Framed::Message(message)),
        Err(e) => Ok(Framed::Bad(
            ErrorCode::InvalidRequest,
            format!("not a JSON-RPC request, response or notification: {e}"),
        )),
    }
}

struct Server<'a> {
    output: &'a mut dyn Write,
    log: &'a mut dyn Write,
    load_card: CardLoader,
    /// Set by `initialize`.
    setup: Option<Setup>,
    documents: Documents,
    /// `shutdown` was received: only `exit` is expected now.
    shutdown: bool,
}

/// A request's failure: the JSON-RPC error code and message.
type Failure = (ErrorCode, String);

fn params<P: DeserializeOwned>(request: &Request) -> Result<P, Failure> {
    serde_json::from_value(request.params.clone()).map_err(|e| {
        (
            ErrorCode::InvalidParams,
            format!("{}: bad params: {e}", request.method),
        )
    })
}

impl Server<'_> {
    /// A line on the log (stderr); a log that cannot be written is not worth failing for.
    fn note(&mut self, text: &str) {
        let _ = writeln!(self.log, "moec lsp: {text}");
    }

    fn send(&mut self, message: impl Into<Message>) -> std::io::Result<()> {
        message.into().write(&mut self.output)
    }

    /// An error response; `id` `None` is JSON-RPC's `null` (the request's id is unknown).
    fn send_error(
        &mut self,
        id: Option<RequestId>,
        code: ErrorCode,
        message: String,
    ) -> std::io::Result<()> {
        match id {
            Some(id) => self.send(Response::new_err(id, code as i32, message)),
            None => {
                // `lsp_server`'s ids cannot be null; this one response is written by hand.
                let body = serde_json::json!({
                    "jsonrpc": "2.0",
                    "id": null,
                    "error": { "code": code as i32, "message": message },
                })
                .to_string();
                write!(self.output, "Content-Length: {}\r\n\r\n{body}", body.len())?;
                self.output.flush()
            }
        }
    }

    fn notify(&mut self, method: &str, params: impl serde::Serialize) -> std::io::Result<()> {
        self.send(Notification::new(method.to_string(), params))
    }

    fn request(&mut self, request: Request) -> std::io::Result<()> {
        let id = request.id.clone();
        let result = if request.method == "initialize" {
            self.initialize(&request)
        } else if self.setup.is_none() {
            Err((
                ErrorCode::ServerNotInitialized,
                format!("`{}` before `initialize`", request.method),
            ))
        } else if self.shutdown {
            Err((
                ErrorCode::InvalidRequest,
                format!("`{}` after `shutdown`", request.method),
            ))
        } else {
            self.dispatch(&request)
        };
        match result {
            Ok(value) => self.send(Response::new_ok(id, value)),
            Err((code, message)) => {
                self.note(&message);
                self.send_error(Some(id), code, message)
            }
        }
    }

    fn dispatch(&mut self, request: &Request) -> Result<serde_json::Value, Failure> {
        let json = |v: Result<serde_json::Value, serde_json::Error>| {
            v.map_err(|e| (ErrorCode::InternalError, e.to_string()))
        };
        match request.method.as_str() {
            "shutdown" => {
                self.shutdown = true;
                Ok(serde_json::Value::Null)
            }
            "textDocument/hover" => {
                let p: HoverParams = params(request)?;
                let at = &p.text_document_position_params;
                json(serde_json::to_value(
                    self.hover(&at.text_document.uri, at.position),
                ))
            }
            "textDocument/definition" => {
                let p: GotoDefinitionParams = params(request)?;
                let at = &p.text_document_position_params;
                json(serde_json::to_value(
                    self.definition(&at.text_document.uri, at.position),
                ))
            }
            "textDocument/completion" => {
                let p: CompletionParams = params(request)?;
                let at = &p.text_document_position;
                json(serde_json::to_value(
                    self.completion(&at.text_document.uri, at.position),
                ))
            }
            other => Err((
                ErrorCode::MethodNotFound,
                format!("`{other}` is not supported"),
            )),
        }
    }

    fn initialize(&mut self, request: &Request) -> Result<serde_json::Value, Failure> {
        if self.setup.is_some() {
            return Err((
                ErrorCode::InvalidRequest,
                "`initialize` was already received".to_string(),
            ));
        }
        let init: InitializeParams = params(request)?;
        let chosen = Settings::from_json(init.initialization_options)
            .and_then(|(s, unknown)| Ok((s.resolve(self.load_card)?, unknown)));
        let chosen = match chosen {
            Ok((setup, unknown)) if !unknown.is_empty() => {
                let text = format!(
                    "initializationOptions: ignored unknown key(s) {}; known: {}",
                    unknown.join(", "),
                    Settings::KEYS.join(", ")
                );
                self.note(&text);
                let shown = ShowMessageParams {
                    typ: MessageType::WARNING,
                    message: format!("moec lsp: {text}"),
                };
                if let Err(e) = self.notify("window/showMessage", shown) {
                    return Err((ErrorCode::InternalError, e.to_string()));
                }
                Ok(setup)
            }
            other => other.map(|(setup, _)| setup),
        };
        let setup = match chosen {
            Ok(setup) => setup,
            Err(why) => {
                // Not silent: the user is told, in the editor and the log, what is used.
                let text = format!(
                    "{why}; compiling for the defaults instead ({}, no hardware profile)",
                    super::settings::DEFAULT_MODEL
                );
                self.note(&text);
                let shown = ShowMessageParams {
                    typ: MessageType::WARNING,
                    message: format!("moec lsp: {text}"),
                };
                if let Err(e) = self.notify("window/showMessage", shown) {
                    return Err((ErrorCode::InternalError, e.to_string()));
                }
                Settings::default()
                    .resolve(self.load_card)
                    .map_err(|e| (ErrorCode::InternalError, e))?
            }
        };
        self.note(&format!("compiling for {}", setup.describe()));
        self.setup = Some(setup);
        let capabilities = ServerCapabilities {
            text_document_sync: Some(TextDocumentSyncCapability::Options(
                TextDocumentSyncOptions {
                    open_close: Some(true),
                    change: Some(TextDocumentSyncKind::FULL),
                    save: Some(TextDocumentSyncSaveOptions::Supported(true)),
                    ..TextDocumentSyncOptions::default()
                },
            )),
            hover_provider: Some(HoverProviderCapability::Simple(true)),
            definition_provider: Some(OneOf::Left(true)),
            completion_provider: Some(CompletionOptions {
                trigger_characters: Some(vec![".".to_string(), "\"".to_string()]),
                ..CompletionOptions::default()
            }),
            ..ServerCapabilities::default()
        };
        let result = InitializeResult {
            capabilities,
            server_info: Some(ServerInfo {
                name: "moec".to_string(),
                version: Some(env!("CARGO_PKG_VERSION").to_string()),
            }),
        };
        serde_json::to_value(result).map_err(|e| (ErrorCode::InternalError, e.to_string()))
    }

    fn notification(&mut self, n: Notification) -> std::io::Result<()> {
        let Some(setup) = self.setup.clone() else {
            // The protocol: notifications before `initialize` are dropped.
            self.note(&format!("dropped `{}` before `initialize`", n.method));
            return Ok(());
        };
        fn parse<P: DeserializeOwned>(n: &Notification) -> Result<P, String> {
            serde_json::from_value(n.params.clone())
                .map_err(|e| format!("{}: bad params: {e}", n.method))
        }
        let action = match n.method.as_str() {
            "initialized" => return Ok(()),
            "textDocument/didOpen" => parse::<DidOpenTextDocumentParams>(&n).map(|p| {
                let d = p.text_document;
                self.documents.set(d.uri.clone(), d.version, d.text, &setup);
                Action::Publish(d.uri)
            }),
            "textDocument/didChange" => parse::<DidChangeTextDocumentParams>(&n).and_then(|p| {
                // Full sync: the last change holds the whole text.
                let uri = p.text_document.uri;
                match p.content_changes.into_iter().next_back() {
                    Some(change) if change.range.is_none() => {
                        let version = p.text_document.version;
                        self.documents
                            .set(uri.clone(), version, change.text, &setup);
                        Ok(Action::Publish(uri))
                    }
                    Some(_) => Err(format!(
                        "didChange for {}: a ranged change, but this server asked for full text",
                        uri.as_str()
                    )),
                    None => Ok(Action::Nothing),
                }
            }),
            "textDocument/didSave" => parse::<DidSaveTextDocumentParams>(&n).map(|p| {
                let uri = p.text_document.uri;
                let version = self.documents.get(&uri).map(|d| d.version);
                match (version, p.text) {
                    (Some(version), Some(text)) => {
                        self.documents.set(uri.clone(), version, text, &setup);
                        Action::Publish(uri)
                    }
                    (Some(_), None) => Action::Publish(uri),
                    (None, _) => Action::Nothing,
                }
            }),
            "textDocument/didClose" => parse::<DidCloseTextDocumentParams>(&n).map(|p| {
                let uri = p.text_document.uri;
                if self.documents.close(&uri) {
                    Action::Clear(uri)
                } else {
                    Action::Nothing
                }
            }),
            method if method.starts_with("$/") => return Ok(()),
            other => {
                self.note(&format!("ignored notification `{other}`"));
                return Ok(());
            }
        };
        match action {
            Ok(Action::Publish(uri)) => self.publish(&uri),
            Ok(Action::Clear(uri)) => self.notify(
                "textDocument/publishDiagnostics",
                PublishDiagnosticsParams::new(uri, Vec::new(), None),
            ),
            Ok(Action::Nothing) => Ok(()),
            Err(why) => {
                self.note(&why);
                Ok(())
            }
        }
    }

    /// Publishes a document's diagnostics.
    fn publish(&mut self, uri: &Uri) -> std::io::Result<()> {
        let Some(document) = self.documents.get(uri) else {
            return Ok(());
        };
        let params = PublishDiagnosticsParams::new(
            uri.clone(),
            lsp_diagnostics(uri, document),
            Some(document.version),
        );
        self.notify("textDocument/publishDiagnostics", params)
    }

    /// The open document and the byte offset of `position` in it.
    fn locate(&mut self, uri: &Uri, position: Position) -> Option<(&Document, usize)> {
        let Some(document) = self.documents.get(uri) else {
            let _ = writeln!(self.log, "moec lsp: {} is not open", uri.as_str());
            return None;
        };
        let offset = document.index.offset(&document.text, position)?;
        Some((document, offset))
    }

    fn hover(&mut self, uri: &Uri, position: Position) -> Option<Hover> {
        let setup = self.setup.clone()?;
        let (document, offset) = self.locate(uri, position)?;
        let (text, span) = hover::hover(document, &setup, offset)?;
        Some(Hover {
            contents: HoverContents::Markup(MarkupContent {
                kind: MarkupKind::Markdown,
                value: text,
            }),
            range: Some(document.index.range(&document.text, span)),
        })
    }

    fn definition(&mut self, uri: &Uri, position: Position) -> Option<GotoDefinitionResponse> {
        let (document, offset) = self.locate(uri, position)?;
        let locations: Vec<Location> = definition::definitions(document, offset)
            .into_iter()
            .map(|span| Location::new(uri.clone(), document.index.range(&document.text, span)))
            .collect();
        match locations.len() {
            0 => None,
            1 => locations
                .into_iter()
                .next()
                .map(GotoDefinitionResponse::Scalar),
            _ => Some(GotoDefinitionResponse::Array(locations)),
        }
    }

    fn completion(&mut self, uri: &Uri, position: Position) -> Option<CompletionResponse> {
        let setup = self.setup.clone()?;
        let (document, offset) = self.locate(uri, position)?;
        Some(CompletionResponse::Array(completion::completions(
            document, &setup, offset,
        )))
    }
}

/// What a notification asks of the server afterwards.
enum Action {
    /// Publish the document's diagnostics.
    Publish(Uri),
    /// Clear the closed document's diagnostics.
    Clear(Uri),
    Nothing,
}

/// The document's diagnostics in the protocol's terms: the primary label's span is the
/// range; the message is the checker's sentence, then the primary label's text and the
/// help; the other labels are related information.
pub fn lsp_diagnostics(uri: &Uri, document: &Document) -> Vec<lsp_types::Diagnostic> {
    let text = &document.text;
    let index = &document.index;
    let mut out: Vec<lsp_types::Diagnostic> = document
        .analysis
        .diagnostics
        .iter()
        .map(|d| convert(uri, text, index, d))
        .collect();
    if let Some(over) = &document.analysis.over_budget {
        // A budget has no place in the text: the file's first character carries it.
        out.push(lsp_types::Diagnostic {
            range: Range::default(),
            severity: Some(DiagnosticSeverity::ERROR),
            code: Some(NumberOrString::String("memory::over_budget".to_string())),
            source: Some("moec".to_string()),
            message: over.clone(),
            ..lsp_types::Diagnostic::default()
        });
    }
    out
}

fn convert(
    uri: &Uri,
    text: &str,
    index: &LineIndex,
    d: &diag::Diagnostic,
) -> lsp_types::Diagnostic {
    let range = d
        .primary_span()
        .map_or_else(Range::default, |span| index.range(text, span));
    let mut message = d.message.clone();
    if let Some(label) = d.labels.first().filter(|l| !l.text.is_empty()) {
        message.push_str(&format!("\n{}", label.text));
    }
    if let Some(help) = &d.help {
        message.push_str(&format!("\nhelp: {help}"));
    }
    let related: Vec<DiagnosticRelatedInformation> = d
        .labels
        .iter()
        .skip(1)
        .map(|l| DiagnosticRelatedInformation {
            location: Location::new(uri.clone(), index.range(text, l.span)),
            message: l.text.clone(),
        })
        .collect();
    lsp_types::Diagnostic {
        range,
        severity: Some(match d.severity {
            Severity::Error => DiagnosticSeverity::ERROR,
            Severity::Warning => DiagnosticSeverity::WARNING,
        }),
        code: Some(NumberOrString::String(d.code.as_str().to_string())),
        source: Some("moec".to_string()),
        message,
        related_information: (!related.is_empty()).then_some(related),
        ..lsp_types::Diagnostic::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn frame(message: serde_json::Value) -> Vec<u8> {
        let body = message.to_string();
        format!("Content-Length: {}\r\n\r\n{body}", body.len()).into_bytes()
    }

    fn load(
        name: &str,
        _formats: Option<&str>,
        backend: &crate::runtime::Registration,
    ) -> Result<crate::model::card::ModelCard, String> {
        crate::model::card::ModelCard::load(name)
            .map(|card| crate::runtime::registry::card_for(backend, &card))
            .map_err(|e| e.to_string())
    }

    /// Runs a session on `input`; gives how it ended, the messages written and the log.
    fn session(input: &[u8]) -> (Ending, Vec<serde_json::Value>, String) {
        let mut output = Vec::new();
        let mut log = Vec::new();
        let ending = serve(&mut &input[..], &mut output, &mut log, load).unwrap();
        // Split by hand: the null-id error responses are no `lsp_server` message.
        let mut messages = Vec::new();
        let mut rest = String::from_utf8(output).unwrap();
        while let Some(header_end) = rest.find("\r\n\r\n") {
            let length: usize = rest["Content-Length: ".len()..header_end].parse().unwrap();
            let body = header_end + 4..header_end + 4 + length;
            messages.push(serde_json::from_str(&rest[body.clone()]).unwrap());
            rest = rest[body.end..].to_string();
        }
        assert!(rest.is_empty(), "{rest:?}");
        (ending, messages, String::from_utf8(log).unwrap())
    }

    #[test]
    fn bad_input_is_answered_and_the_session_goes_on() {
        let mut input = Vec::new();
        // Not JSON, JSON that is no message, no Content-Length, an oversized body.
        input.extend(b"Content-Length: 3\r\n\r\n{x}");
        input.extend(b"Content-Length: 2\r\n\r\n[]");
        input.extend(b"X-Other: 1\r\n\r\n");
        input.extend(format!("Content-Length: {}\r\n\r\n", MAX_MESSAGE_BYTES + 1).as_bytes());
        input.extend(vec![b' '; MAX_MESSAGE_BYTES + 1]);
        input.extend(frame(
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"capabilities": {}, "initializationOptions": {"model": "no-such-card"}}}),
        ));
        // A document URI that is not a URI, a ranged change, an unknown notification.
        input.extend(frame(json!({"jsonrpc": "2.0", "method": "textDocument/didOpen",
            "params": {"textDocument": {"uri": "not a uri", "languageId": "sched", "version": 1, "text": ""}}})));
        input.extend(frame(json!({"jsonrpc": "2.0", "method": "textDocument/didChange",
            "params": {"textDocument": {"uri": "file:///a.sched", "version": 2}, "contentChanges": [
                {"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}}, "text": "x"}]}})));
        input.extend(frame(
            json!({"jsonrpc": "2.0", "method": "no/such", "params": null}),
        ));
        // Hover on a document that is not open: null.
        input.extend(frame(json!({"jsonrpc": "2.0", "id": 2, "method": "textDocument/hover",
            "params": {"textDocument": {"uri": "file:///b.sched"}, "position": {"line": 0, "character": 0}}})));
        input.extend(frame(json!({"jsonrpc": "2.0", "method": "exit"})));
        let (ending, messages, log) = session(&input);
        // `exit` without `shutdown`.
        assert_eq!(ending, Ending::Abrupt);
        let codes: Vec<i64> = messages
            .iter()
            .filter(|m| m.get("id").is_some_and(|id| id.is_null()))
            .map(|m| m["error"]["code"].as_i64().unwrap())
            .collect();
        assert_eq!(codes, [-32700, -32600, -32700, -32600], "{messages:#?}");
        // The unknown card is said, in the editor and the log, and the defaults are used.
        let shown = messages
            .iter()
            .find(|m| m["method"] == "window/showMessage")
            .unwrap();
        assert!(
            shown["params"]["message"]
                .as_str()
                .unwrap()
                .contains("no-such-card"),
            "{shown}"
        );
        assert!(
            log.contains("compiling for mixtral-tiny, no hardware profile"),
            "{log}"
        );
        let initialized = messages.iter().find(|m| m["id"] == 1).unwrap();
        assert!(initialized["result"]["capabilities"].is_object());
        assert!(log.contains("didOpen: bad params"), "{log}");
        assert!(log.contains("a ranged change"), "{log}");
        assert!(log.contains("ignored notification `no/such`"), "{log}");
        let hover = messages.iter().find(|m| m["id"] == 2).unwrap();
        assert!(
            hover["result"].is_null() && hover.get("error").is_none(),
            "{hover}"
        );
    }

    #[test]
    fn the_input_ending_early_is_an_abrupt_end() {
        let (ending, messages, log) = session(b"Content-Length: 50\r\n\r\n{\"jsonrpc\"");
        assert_eq!(ending, Ending::Abrupt);
        assert!(messages.is_empty());
        assert!(log.contains("the input ended"), "{log}");
    }
}
