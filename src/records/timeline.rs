//! Timelines of spans on streams: the format both `moec simulate` (predicted) and the
//! runtime (measured) write, as a Chrome/Perfetto trace or a Gantt chart in SVG.
//!
//! Takes streams and spans (stream, name, op, start, end in seconds); gives trace JSON
//! (`traceEvents` with complete "X" events in microseconds, one thread per stream, so
//! chrome://tracing and ui.perfetto.dev open it) and a self-contained SVG (one row per
//! stream, one colour per op, a legend and a time axis). Guarantees: output depends only
//! on the input (colours come from the op's position in first-appearance order).

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// One task's execution on a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Span {
    /// Index into [`Timeline::streams`].
    pub stream: usize,
    /// Task label (e.g. `post_attn L3 ub1`).
    pub name: String,
    /// Op or copy kind; spans of one op share a colour.
    pub op: String,
    /// Start, seconds from the timeline's origin.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// A set of spans on named streams.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Timeline {
    /// What produced it (`predicted: cgopipe on t4`).
    pub title: String,
    /// Stream names; also the Gantt rows, top to bottom.
    pub streams: Vec<String>,
    /// The spans.
    pub spans: Vec<Span>,
}

/// Colours for ops, picked to stay distinct on white (Tableau 10 plus extras).
const PALETTE: &[&str] = &[
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac", "#1f77b4", "#17becf", "#bcbd22", "#8c564b",
];

fn escape_xml(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Timeline {
    /// Seconds from the earliest start to the latest end.
    pub fn duration(&self) -> f64 {
        let last = self.spans.iter().map(|s| s.end).fold(0.0f64, f64::max);
        if self.spans.is_empty() {
            0.0
        } else {
            last - self.origin()
        }
    }

    /// The earliest start (0 for an empty timeline).
    fn origin(&self) -> f64 {
        let first = self
            .spans
            .iter()
            .map(|s| s.start)
            .fold(f64::INFINITY, f64::min);
        if first.is_finite() {
            first
        } else {
            0.0
        }
    }

    /// The spans overlapping `[from, to)` seconds (relative to the earliest start), clipped
    /// to it and shifted so the window starts at 0: a zoom for Gantt charts.
    pub fn window(&self, from: f64, to: f64) -> Timeline {
        let origin = self.origin();
        let spans = self
            .spans
            .iter()
            .filter(|s| s.end - origin > from && s.start - origin < to)
            .map(|s| Span {
                start: (s.start - origin).max(from) - from,
                end: (s.end - origin).min(to) - from,
                ..s.clone()
            })
            .collect();
        Timeline {
            title: self.title.clone(),
            streams: self.streams.clone(),
            spans,
        }
    }

    /// Ops in first-appearance order (the legend and colour order).
    pub fn ops(&self) -> Vec<&str> {
        let mut ops: Vec<&str> = Vec::new();
        for span in &self.spans {
            if !ops.contains(&span.op.as_str()) {
                ops.push(&span.op);
            }
        }
        ops
    }

    /// Chrome trace event JSON (the "JSON object format" with `traceEvents`).
    pub fn to_chrome_trace(&self) -> serde_json::Value {
        let mut events = Vec::with_capacity(self.spans.len() + self.streams.len() + 1);
        events.push(serde_json::json!({
            "name": "process_name", "ph": "M", "pid": 1, "tid": 0,
            "args": { "name": self.title },
        }));
        for (index, name) in self.streams.iter().enumerate() {
            events.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": 1, "tid": index,
                "args": { "name": name },
            }));
            events.push(serde_json::json!({
                "name": "thread_sort_index", "ph": "M", "pid": 1, "tid": index,
                "args": { "sort_index": index },
            }));
        }
        for span in &self.spans {
            events.push(serde_json::json!({
                "name": span.name, "cat": span.op, "ph": "X", "pid": 1, "tid": span.stream,
                "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6,
            }));
        }
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }

    /// A Gantt chart: one row per stream, spans coloured by op, legend, time axis in ms.
    pub fn to_svg(&self, width: f64) -> String {
        let label_width = 110.0;
        let row_height = 26.0;
        let top = 40.0;
        let plot_width = (width - label_width - 20.0).max(100.0);
        let rows = self.streams.len().max(1) as f64;
        let ops = self.ops();
        let legend_rows = ops.len().div_ceil(4).max(1) as f64;
        let axis_y = top + rows * row_height;
        let height = axis_y + 40.0 + legend_rows * 20.0 + 10.0;
        let origin = self.origin();
        let duration = self.duration().max(1e-12);
        let x_of = |t: f64| label_width + (t - origin) / duration * plot_width;
        let colour =
            |op: &str| PALETTE[ops.iter().position(|o| *o == op).unwrap_or(0) % PALETTE.len()];

        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{label_width}" y="22" font-size="14" font-weight="bold">{}</text>"#,
            escape_xml(&self.title)
        );
        for (index, name) in self.streams.iter().enumerate() {
            let y = top + index as f64 * row_height;
            let fill = if index % 2 == 0 { "#f4f4f4" } else { "#ffffff" };
            let _ = writeln!(
                svg,
                r#"<rect x="{label_width}" y="{y}" width="{plot_width}" height="{row_height}" fill="{fill}"/>"#
            );
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                label_width - 8.0,
                y + row_height * 0.65,
                escape_xml(name)
            );
        }
        for span in &self.spans {
            let x = x_of(span.start);
            let w = (x_of(span.end) - x).max(0.5);
            let y = top + span.stream as f64 * row_height + 3.0;
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.2}" y="{y:.1}" width="{w:.2}" height="{:.1}" fill="{}" stroke="white" stroke-width="0.5"><title>{} ({:.3} ms)</title></rect>"#,
                row_height - 6.0,
                colour(&span.op),
                escape_xml(&span.name),
                (span.end - span.start) * 1e3
            );
        }
        // Time axis with about eight round ticks.
        let _ = writeln!(
            svg,
            r#"<line x1="{label_width}" y1="{axis_y}" x2="{:.1}" y2="{axis_y}" stroke="black"/>"#,
            label_width + plot_width
        );
        let raw_step = duration / 8.0;
        let magnitude = 10f64.powf(raw_step.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * magnitude)
            .find(|s| *s >= raw_step)
            .unwrap_or(raw_step);
        let mut tick = 0.0;
        while tick <= duration * 1.0001 {
            let x = x_of(origin + tick);
            let _ = writeln!(
                svg,
                r#"<line x1="{x:.1}" y1="{axis_y}" x2="{x:.1}" y2="{:.1}" stroke="black"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                axis_y + 5.0,
                axis_y + 18.0,
                format_ms(tick * 1e3)
            );
            tick += step;
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">time (ms)</text>"#,
            label_width + plot_width,
            axis_y + 32.0
        );
        for (index, op) in ops.iter().enumerate() {
            let x = label_width + (index % 4) as f64 * 280.0;
            let y = axis_y + 44.0 + (index / 4) as f64 * 20.0;
            let _ = writeln!(
                svg,
                r#"<rect x="{x}" y="{y}" width="14" height="14" fill="{}"/><text x="{:.0}" y="{:.0}">{}</text>"#,
                colour(op),
                x + 20.0,
                y + 12.0,
                escape_xml(op)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

fn format_ms(ms: f64) -> String {
    if ms == 0.0 {
        "0".to_string()
    } else if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 1.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Timeline {
        Timeline {
            title: "t <&>".to_string(),
            streams: vec!["gpu".to_string(), "h2d".to_string()],
            spans: vec![
                Span {
                    stream: 1,
                    name: "w L1".into(),
                    op: "copy".into(),
                    start: 0.0,
                    end: 0.002,
                },
                Span {
                    stream: 0,
                    name: "post L0".into(),
                    op: "post_attn".into(),
                    start: 0.001,
                    end: 0.003,
                },
            ],
        }
    }

    #[test]
    fn chrome_trace_has_one_complete_event_per_span_in_microseconds() {
        let trace = sample().to_chrome_trace();
        let events = trace["traceEvents"].as_array().unwrap();
        let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(complete.len(), 2);
        assert_eq!(complete[1]["ts"], 1000.0);
        assert_eq!(complete[1]["dur"], 2000.0);
        assert_eq!(complete[1]["tid"], 0);
        assert!(events
            .iter()
            .any(|e| e["name"] == "thread_name" && e["args"]["name"] == "h2d"));
    }

    #[test]
    fn window_clips_and_shifts() {
        let zoom = sample().window(0.0015, 0.0025);
        assert_eq!(zoom.spans.len(), 2);
        assert!(
            (zoom.spans[0].start - 0.0).abs() < 1e-15 && (zoom.spans[0].end - 0.0005).abs() < 1e-15
        );
        assert!((zoom.spans[1].end - 0.001).abs() < 1e-15);
    }

    #[test]
    fn svg_has_rows_spans_legend_and_escapes_text() {
        let svg = sample().to_svg(800.0);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("t &lt;&amp;&gt;"));
        assert_eq!(svg.matches("<title>").count(), 2);
        assert!(svg.contains(">post_attn</text>") && svg.contains(">copy</text>"));
        assert!(svg.contains("time (ms)"));
    }
}
