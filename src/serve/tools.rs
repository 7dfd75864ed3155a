//! OpenAI tool calls (`tools`, `tool_choice`) for chat completions.
//!
//! A call is grammar-constrained output, the same path as `response_format`: the tools a
//! call may name become one JSON schema, `{"name": <a tool's name>, "arguments": <valid
//! under that tool's `parameters`>}` (an `anyOf` over the tools), which llguidance holds
//! the sampled tokens to; the text is then read back as `message.tool_calls`. The model
//! learns the tools from a system message moec writes (see [`system_text`]), since the
//! chat templates moec renders see only roles and texts.
//!
//! `tool_choice` `"none"` ignores the tools, `"required"` forces a call of one of them,
//! `{"type": "function", "function": {"name": N}}` a call of N, and `"auto"` (OpenAI's
//! default when tools are given) lets the model write either: a Lark grammar (see
//! [`auto_grammar`]) of a call, or text that does not start with `{`.

use super::openai::ApiError;
use serde_json::{json, Value};

/// One tool a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// The function's name (`[A-Za-z0-9_-]{1,64}`, as OpenAI requires).
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// The JSON schema its arguments must satisfy.
    pub parameters: Value,
}

/// What a request's `tools` and `tool_choice` ask of the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolUse {
    /// The tools a call may name.
    pub tools: Vec<Tool>,
    /// The output may be text instead (`"auto"`).
    pub optional: bool,
}

/// The tools a call must (or may) be among, from a request's `tools` and `tool_choice`:
/// `None` when the output is plain text (no tools, or `tool_choice: "none"`).
pub fn tool_use(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
) -> Result<Option<ToolUse>, ApiError> {
    let tools = match tools {
        None | Some([]) => {
            return match choice {
                None => Ok(None),
                Some(c) if c == "none" => Ok(None),
                Some(_) => Err(ApiError::invalid(
                    "tool_choice needs a non-empty `tools` list",
                    Some("tool_choice"),
                )),
            }
        }
        Some(list) => list,
    };
    let mut parsed: Vec<Tool> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let tool = parse_tool(i, t)?;
        if parsed.iter().any(|p| p.name == tool.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}]: the name `{}` is given twice", tool.name),
                Some("tools"),
            ));
        }
        parsed.push(tool);
    }
    shared_definitions(&parsed).map_err(|why| ApiError::invalid(why, Some("tools")))?;
    let all = |optional| {
        Ok(Some(ToolUse {
            tools: parsed.clone(),
            optional,
        }))
    };
    match choice {
        None => all(true),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(None),
            "required" => all(false),
            "auto" => all(true),
            other => Err(ApiError::invalid(
                format!("tool_choice `{other}` is not one of \"none\", \"required\", \"auto\" or a function"),
                Some("tool_choice"),
            )),
        },
        Some(Value::Object(o)) => {
            let name = match (o.get("type"), o.get("function").and_then(|f| f.get("name"))) {
                (Some(t), Some(Value::String(name))) if t == "function" => name,
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        Some("tool_choice"),
                    ))
                }
            };
            match parsed.iter().find(|t| &t.name == name) {
                Some(tool) => Ok(Some(ToolUse {
                    tools: vec![tool.clone()],
                    optional: false,
                })),
                None => Err(ApiError::invalid(
                    format!("tool_choice names the function `{name}`, which is not in tools"),
                    Some("tool_choice"),
                )),
            }
        }
        Some(_) => Err(ApiError::invalid(
            "tool_choice must be a string or an object",
            Some("tool_choice"),
        )),
    }
}

fn parse_tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let bad = |what: &str| ApiError::invalid(format!("tools[{i}]: {what}"), Some("tools"));
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("`type` must be \"function\""));
    }
    let Some(f) = t.get("function").and_then(Value::as_object) else {
        return Err(bad("`function` must be an object"));
    };
    let name = match f.get("name") {
        Some(Value::String(n)) => n.clone(),
        _ => return Err(bad("`function.name` is missing")),
    };
    let valid_name = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !valid_name {
        return Err(bad(&format!(
            "the function name `{name}` must be 1 to 64 of a-z, A-Z, 0-9, _ and -"
        )));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return Err(bad("`function.description` must be a string")),
    };
    let parameters = match f.get("parameters") {
        // OpenAI's meaning of no parameters: a function that takes none.
        None | Some(Value::Null) => {
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        }
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(bad("`function.parameters` must be a JSON schema object")),
    };
    Ok(Tool {
        name,
        description,
        parameters,
    })
}

/// Where a parameters schema keeps the schemas its `$ref`s name (`#/$defs/X`,
/// `#/definitions/X`).
const DEFINITIONS: [&str; 2] = ["$defs", "definitions"];

/// The tools' `$defs` and `definitions` merged, for the call schema's root: a `$ref` is
/// resolved from the root of the schema it is in, and a tool's parameters sit inside the
/// call schema. The same name defined differently by two tools is an error.
fn shared_definitions(tools: &[Tool]) -> Result<serde_json::Map<String, Value>, String> {
    let mut root = serde_json::Map::new();
    for key in DEFINITIONS {
        let mut merged = serde_json::Map::new();
        for t in tools {
            let Some(defs) = t.parameters.get(key) else {
                continue;
            };
            let Some(defs) = defs.as_object() else {
                return Err(format!(
                    "the parameters of `{}`: `{key}` must be an object",
                    t.name
                ));
            };
            for (name, schema) in defs {
                match merged.get(name) {
                    Some(other) if other != schema => {
                        return Err(format!(
                            "`{key}/{name}` is defined differently by two tools' parameters (`{}` and another); the tools of one request share one namespace of definitions",
                            t.name
                        ))
                    }
                    _ => {
                        merged.insert(name.clone(), schema.clone());
                    }
                }
            }
        }
        if !merged.is_empty() {
            root.insert(key.to_string(), Value::Object(merged));
        }
    }
    Ok(root)
}

/// The schema a call's text must satisfy: `{"name": N, "arguments": A}` with A valid
/// under N's parameters, for one of `tools`, with the tools' definitions at its root.
pub fn call_schema(tools: &[Tool]) -> Value {
    let mut schema = call_alternatives(tools);
    // `tool_use` has refused conflicting definitions, so this is every tool's.
    if let (Ok(defs), Some(root)) = (shared_definitions(tools), schema.as_object_mut()) {
        root.extend(defs);
    }
    schema
}

fn call_alternatives(tools: &[Tool]) -> Value {
    let one = |t: &Tool| {
        json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    };
    match tools {
        [t] => one(t),
        _ => json!({"anyOf": tools.iter().map(one).collect::<Vec<_>>()}),
    }
}

/// `"auto"`'s grammar: a call (under [`call_schema`], compact JSON) or text whose first
/// character is not `{` (so a reply that opens a JSON object is a call).
pub fn auto_grammar(tools: &[Tool]) -> String {
    let mut schema = call_schema(tools);
    schema["x-guidance"] = json!({"whitespace_flexible": false});
    format!("start: call | text\ncall: %json {schema}\ntext: /[^{{][\\s\\S]*/\n")
}

/// The system text that tells the model the tools and the shape of a call.
pub fn system_text(tools: &[Tool]) -> String {
    let mut text = String::from(
        "You can call these functions. To call one, reply with only a JSON object {\"name\": <the function's name>, \"arguments\": <its arguments>}.\nFunctions:",
    );
    for t in tools {
        let mut entry = json!({"name": t.name, "parameters": t.parameters});
        if let Some(d) = &t.description {
            entry["description"] = json!(d);
        }
        text.push('\n');
        text.push_str(&entry.to_string());
    }
    text
}

/// An assistant message's earlier `tool_calls` as text for the prompt: each call in the
/// shape the model is asked to write, one per line.
pub fn history_text(calls: &[Value], message: usize) -> Result<String, ApiError> {
    let mut lines = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let bad = |what: &str| {
            ApiError::invalid(
                format!("messages[{message}].tool_calls[{j}]: {what}"),
                Some("messages"),
            )
        };
        let f = call
            .get("function")
            .ok_or_else(|| bad("`function` is missing"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("`function.name` is missing"))?;
        let arguments = match f.get("arguments") {
            Some(Value::String(a)) => serde_json::from_str::<Value>(a)
                .map_err(|e| bad(&format!("`function.arguments` is not JSON: {e}")))?,
            _ => return Err(bad("`function.arguments` must be a string of JSON")),
        };
        lines.push(json!({"name": name, "arguments": arguments}).to_string());
    }
    Ok(lines.join("\n"))
}

/// A call's head as the grammar writes it with the name first (`{"name":"N","arguments":`):
/// the name and the text after the head (the arguments so far). `None` until the head is
/// whole, or when the text does not open that way (then the call is sent once whole).
pub fn call_head(text: &str) -> Option<(&str, &str)> {
    let rest = text.strip_prefix("{\"name\":\"")?;
    // Names are [A-Za-z0-9_-]: no escaped quote can end one early.
    let end = rest.find('"')?;
    let arguments = rest[end..].strip_prefix("\",\"arguments\":")?;
    Some((&rest[..end], arguments))
}

/// The call a completion's text holds, as a `tool_calls` entry with id `id`; `None` when
/// the text is not a whole call (`max_tokens` cut it).
pub fn call_of(text: &str, id: &str) -> Option<Value> {
    let v: Value = serde_json::from_str(text).ok()?;
    let name = v.get("name")?.as_str()?;
    let arguments = v.get("arguments")?;
    Some(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments.to_string()},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
    }

    #[test]
    fn tool_choice_picks_the_tools_a_call_may_name() {
        let tools = [tool("a"), tool("b")];
        let all = tool_use(Some(&tools), Some(&json!("required")))
            .unwrap()
            .unwrap();
        assert_eq!((all.tools.len(), all.optional), (2, false));
        let named = tool_use(
            Some(&tools),
            Some(&json!({"type": "function", "function": {"name": "b"}})),
        )
        .unwrap()
        .unwrap();
        assert_eq!((named.tools[0].name.as_str(), named.optional), ("b", false));
        assert_eq!(tool_use(Some(&tools), Some(&json!("none"))), Ok(None));
        assert_eq!(tool_use(None, None), Ok(None));
        for choice in [None, Some(json!("auto"))] {
            let auto = tool_use(Some(&tools), choice.as_ref()).unwrap().unwrap();
            assert_eq!((auto.tools.len(), auto.optional), (2, true));
        }
        let unknown = tool_use(
            Some(&tools),
            Some(&json!({"type": "function", "function": {"name": "c"}})),
        )
        .unwrap_err();
        assert!(unknown.message.contains("`c`"), "{}", unknown.message);
        let nameless = [json!({"type": "function", "function": {"parameters": {}}})];
        let e = tool_use(Some(&nameless), Some(&json!("required"))).unwrap_err();
        assert_eq!(e.param, Some("tools"));
        let twice = [tool("a"), tool("a")];
        assert!(tool_use(Some(&twice), Some(&json!("required"))).is_err());
    }

    /// A matcher over a byte-level vocabulary (token b is byte b, 256 is the end).
    fn matcher(grammar: llguidance::api::TopLevelGrammar) -> llguidance::Matcher {
        use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
        let mut words: Vec<Vec<u8>> = (0..=254u8).map(|b| vec![b]).collect();
        // 0xff opens a special token's name in toktrie's convention.
        words.push(b"\xff<[255]>".to_vec());
        words.push(b"\xff<eos>".to_vec());
        let info = TokRxInfo::new(words.len() as u32, 256);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = llguidance::ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        llguidance::Matcher::new(factory.create_parser(grammar))
    }

    fn accepts(grammar: llguidance::api::TopLevelGrammar, text: &str) -> bool {
        let mut m = matcher(grammar);
        let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
        m.consume_tokens(&tokens).is_ok() && m.is_accepting().unwrap_or(false)
    }

    /// `"auto"`'s grammar takes a whole call of a listed tool or text that does not
    /// open with `{`, and nothing else; `"required"`'s takes only the call.
    #[test]
    fn auto_takes_a_call_or_text_and_required_only_a_call() {
        use llguidance::api::TopLevelGrammar;
        let weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": false}}});
        let tools = tool_use(Some(&[weather]), Some(&json!("auto")))
            .unwrap()
            .unwrap()
            .tools;
        let auto = || TopLevelGrammar::from_lark(auto_grammar(&tools));
        let required = || {
            let mut schema = call_schema(&tools);
            schema["x-guidance"] = json!({"whitespace_flexible": false});
            TopLevelGrammar::from_json_schema(schema)
        };
        // The property order is the schema's; either order is a call.
        let call = |name: &str| {
            [
                format!(r#"{{"name":"{name}","arguments":{{"city":"Paris"}}}}"#),
                format!(r#"{{"arguments":{{"city":"Paris"}},"name":"{name}"}}"#),
            ]
        };
        let takes = |g: &dyn Fn() -> TopLevelGrammar, texts: [String; 2]| {
            texts.into_iter().any(|t| accepts(g(), &t))
        };
        assert!(takes(&auto, call("get_weather")));
        assert!(takes(&required, call("get_weather")));
        assert!(!takes(&auto, call("other")));
        assert!(!takes(&required, call("other")));
        assert!(accepts(auto(), "It is sunny in Paris."));
        assert!(!accepts(required(), "It is sunny in Paris."));
        assert!(!accepts(auto(), "{not a call}"));

        // A `$ref` into the tool's own `$defs` resolves inside the call schema.
        let counted = json!({"type": "function", "function": {"name": "count", "parameters": {
            "type": "object", "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
            "properties": {"n": {"$ref": "#/$defs/digit"}},
            "required": ["n"], "additionalProperties": false}}});
        let tools = tool_use(
            Some(std::slice::from_ref(&counted)),
            Some(&json!("required")),
        )
        .unwrap()
        .unwrap()
        .tools;
        let with_ref = || TopLevelGrammar::from_json_schema(call_schema(&tools));
        let digit = |n: &str| {
            [
                format!(r#"{{"name":"count","arguments":{{"n":{n}}}}}"#),
                format!(r#"{{"arguments":{{"n":{n}}},"name":"count"}}"#),
            ]
        };
        assert!(takes(&with_ref, digit("7")));
        assert!(!takes(&with_ref, digit("12")));
        let mut clash = counted.clone();
        clash["function"]["name"] = json!("other");
        clash["function"]["parameters"]["$defs"]["digit"]["maximum"] = json!(5);
        let e = tool_use(Some(&[counted, clash]), Some(&json!("required"))).unwrap_err();
        assert!(e.message.contains("$defs/digit"), "{}", e.message);
    }

    #[test]
    fn a_call_is_read_back_with_its_arguments_as_json_text() {
        let call = call_of(r#"{"arguments":{"x":1},"name":"f"}"#, "call_1").unwrap();
        assert_eq!(call["function"]["name"], "f");
        assert_eq!(call["function"]["arguments"], r#"{"x":1}"#);
        assert_eq!(call["id"], "call_1");
        assert_eq!(call_of(r#"{"arguments":{"x":"#, "call_1"), None);
        assert_eq!(
            call_head(r#"{"name":"f","arguments":{"x""#),
            Some(("f", r#"{"x""#))
        );
        assert_eq!(call_head(r#"{"name":"f","argu"#), None);
        assert_eq!(call_head(r#"{"arguments":{},"name":"f"}"#), None);
        let history = history_text(
            &[json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}})],
            2,
        )
        .unwrap();
        let parsed: Value = serde_json::from_str(&history).unwrap();
        assert_eq!(parsed, json!({"name": "f", "arguments": {"x": 1}}));
        assert!(history_text(&[json!({"function": {"name": "f", "arguments": "{"}})], 0).is_err());
    }
}
