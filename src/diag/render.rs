//! Rendering diagnostics with miette in a deterministic theme.
//!
//! Takes diagnostics plus the source they point into; gives plain text (no colour, fixed
//! width 100, unicode box drawing) identical on every machine, for terminals and snapshots.

use super::{Diagnostic, Severity};
use miette::{GraphicalReportHandler, GraphicalTheme, LabeledSpan, NamedSource, SourceCode};

struct Report<'a> {
    diagnostic: &'a Diagnostic,
    source: &'a NamedSource<String>,
}

impl std::fmt::Debug for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.diagnostic.message)
    }
}

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.diagnostic.message)
    }
}

impl std::error::Error for Report<'_> {}

impl miette::Diagnostic for Report<'_> {
    fn code<'b>(&'b self) -> Option<Box<dyn std::fmt::Display + 'b>> {
        Some(Box::new(self.diagnostic.code.as_str()))
    }

    fn severity(&self) -> Option<miette::Severity> {
        Some(match self.diagnostic.severity {
            Severity::Error => miette::Severity::Error,
            Severity::Warning => miette::Severity::Warning,
        })
    }

    fn help<'b>(&'b self) -> Option<Box<dyn std::fmt::Display + 'b>> {
        self.diagnostic
            .help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn std::fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        if self.diagnostic.labels.is_empty() {
            None
        } else {
            Some(self.source)
        }
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        if self.diagnostic.labels.is_empty() {
            return None;
        }
        let len = self.source.inner().len();
        Some(Box::new(self.diagnostic.labels.iter().enumerate().map(
            move |(i, label)| {
                let start = (label.span.start as usize).min(len);
                let end = (label.span.end as usize).clamp(start, len);
                let end = first_lines(self.source.inner(), start, end);
                let text = Some(label.text.clone());
                if i == 0 {
                    LabeledSpan::new_primary_with_span(text, start..end)
                } else {
                    LabeledSpan::new_with_span(text, start..end)
                }
            },
        )))
    }
}

/// Lines of a label beyond which only its first line is shown.
const MAX_LABEL_LINES: usize = 3;

/// The end of a label's span, cut to the end of its first line when it covers more than
/// [`MAX_LABEL_LINES`] lines: a label on a whole step or loop (a deadlock's step, say)
/// would otherwise print every line of it, burying the other labels. The first line
/// (`decode {`, `for l in 0..layers {`) names what the label means.
fn first_lines(source: &str, start: usize, end: usize) -> usize {
    let Some(text) = source.get(start..end) else {
        return end;
    };
    if text.matches('\n').count() < MAX_LABEL_LINES {
        return end;
    }
    text.find('\n').map_or(end, |i| start + i)
}

/// Renders one diagnostic against `source` (named `name` in the header).
pub fn render(diagnostic: &Diagnostic, name: &str, source: &str) -> String {
    let named = NamedSource::new(name, source.to_string());
    render_with(diagnostic, &named)
}

fn render_with(diagnostic: &Diagnostic, source: &NamedSource<String>) -> String {
    let handler = GraphicalReportHandler::new_themed(GraphicalTheme::unicode_nocolor())
        .with_width(100)
        .with_links(false)
        .with_context_lines(1);
    let mut out = String::new();
    let report = Report { diagnostic, source };
    if handler.render_report(&mut out, &report).is_err() {
        out = format!("{}: {}\n", diagnostic.code.as_str(), diagnostic.message);
    }
    out
}

/// Renders several diagnostics, errors first, each in source order, separated by blank lines.
pub fn render_all(diagnostics: &[Diagnostic], name: &str, source: &str) -> String {
    let named = NamedSource::new(name, source.to_string());
    let mut sorted: Vec<&Diagnostic> = diagnostics.iter().collect();
    sorted.sort_by_key(|d| {
        (
            d.severity,
            d.primary_span().map(|s| (s.start, s.end)),
            d.code,
        )
    });
    sorted
        .iter()
        .map(|d| render_with(d, &named))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diag::Code;
    use crate::span::Span;

    /// Issue 45: a label spanning a whole step printed every line of it between the
    /// diagnostic's other labels; it now shows its first line only.
    #[test]
    fn a_label_over_many_lines_shows_its_first_line() {
        let body: String = (0..40).map(|i| format!("  line {i}\n")).collect();
        let source = format!("decode {{\n{body}}}\ncache ec[1]: gpu evict \"lru\"\n");
        let step_end = source.find("}\n").unwrap() + 1;
        let cache_at = source.find("cache").unwrap();
        let d = Diagnostic::new(Code::ElabUnknownName, "two labels far apart".to_string())
            .label(Span::new(cache_at, cache_at + 5), "the cache")
            .label(Span::new(0, step_end), "the step");
        let out = render(&d, "t.sched", &source);
        assert!(out.contains("decode {"), "{out}");
        assert!(!out.contains("line 20"), "{out}");
        assert!(
            out.contains("the cache") && out.contains("the step"),
            "{out}"
        );
    }
}
