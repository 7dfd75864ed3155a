//! The OpenAI wire format moec speaks: request bodies (parsed strictly: a known field of
//! the wrong type is a 400, an unknown field is ignored as OpenAI's servers do), response
//! and stream-chunk bodies, and the error shape with its status code.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

/// An error in OpenAI's shape, with its HTTP status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    /// OpenAI's error `code`, where it has one.
    pub code: Option<&'static str>,
    /// The request field at fault, if one.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// A 400 about the request.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            code: None,
            param,
        }
    }

    /// Any other status.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            code: None,
            param: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `prompt` or `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl OneOrMany {
    /// As a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// What completions and chat completions share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    /// The model name (any value is accepted: the server serves one model).
    pub model: Option<String>,
    /// Tokens to generate at most.
    pub max_tokens: Option<u64>,
    /// The newer name of `max_tokens` (chat).
    pub max_completion_tokens: Option<u64>,
    /// Softmax temperature; 0 is greedy. OpenAI's default is 1.
    pub temperature: Option<f64>,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// Stop strings (at most 4).
    pub stop: Option<OneOrMany>,
    /// Sampler seed.
    pub seed: Option<i64>,
    /// Completions per prompt; only 1.
    pub n: Option<u64>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// The shape of the output: `text`, `json_object` or `json_schema`.
    pub response_format: Option<ResponseFormat>,
}

/// `response_format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under `json_schema.schema`.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    /// The schema's name (not used).
    pub name: Option<String>,
    /// The JSON schema.
    pub schema: Option<serde_json::Value>,
    /// OpenAI's strict mode; the grammar always holds the output to the schema.
    pub strict: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt (one).
    pub prompt: OneOrMany,
    /// Sampling and length.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// Its text (a list of text parts is joined); may be null for an assistant message
    /// with `tool_calls`.
    pub content: Option<ChatContent>,
    /// An assistant message's calls (`[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`), checked when the prompt is rendered.
    pub tool_calls: Option<Vec<Value>>,
}

/// A message's content: a string or a list of parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ChatContent {
    /// Plain text.
    Text(String),
    /// Parts; only `text` parts are accepted.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's type (`text`).
    #[serde(rename = "type")]
    pub kind: String,
    /// Its text.
    pub text: Option<String>,
}

impl ChatContent {
    /// The text, or why it has none moec can read.
    pub fn text(self) -> Result<String, ApiError> {
        match self {
            ChatContent::Text(t) => Ok(t),
            ChatContent::Parts(parts) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!(
                                    "content parts of type `{kind}` are not supported; only text"
                                ),
                                Some("messages"),
                            ))
                        }
                    }
                }
                Ok(text)
            }
        }
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Functions the model may call (checked by `tools::tool_use`).
    pub tools: Option<Vec<Value>>,
    /// `"none"`, `"required"`, `"auto"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// Sampling and length.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Parses a request body; a JSON syntax error, a missing field or a known field of the
/// wrong type is a 400 that says which.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "the body is not valid JSON"
            }
            _ => "the request does not have the expected fields",
        };
        ApiError::invalid(format!("{what}: {e}"), None)
    })
}
