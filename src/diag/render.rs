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
