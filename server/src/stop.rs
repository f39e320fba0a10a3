//! Stop strings, matched on the detokenized text across token boundaries.
//!
//! Text that could be the beginning of a stop string is held back until the next token shows
//! whether it is one; when a stop string appears, the output ends before it (or after it, with
//! vLLM's `include_stop_str_in_output`).

/// The outcome of adding text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopCheck {
    /// No stop string yet: emit this text.
    Continue(String),
    /// A stop string was found: emit this text and end the sequence.
    Stopped {
        /// The text before (or up to and including) the stop string.
        text: String,
        /// The stop string that matched.
        stop: String,
    },
}

/// Stop-string matcher of one sequence.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    include_stop_in_output: bool,
    pending: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String], include_stop_in_output: bool) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            include_stop_in_output,
            pending: String::new(),
        }
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck::Continue(text.to_string());
        }
        self.pending.push_str(text);
        // The earliest occurrence of any stop string (the longest one on a tie).
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())));
        if let Some((at, stop)) = found {
            let end = if self.include_stop_in_output {
                at + stop.len()
            } else {
                at
            };
            let stop = stop.clone();
            let text = self.pending[..end].to_string();
            self.pending.clear();
            return StopCheck::Stopped { text, stop };
        }
        let hold = self.held_back_len();
        let emit_to = self.pending.len() - hold;
        let emit = self.pending[..emit_to].to_string();
        self.pending.drain(..emit_to);
        StopCheck::Continue(emit)
    }

    /// The text held back, when the sequence ends without a stop string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn held_back_len(&self) -> usize {
        let p = &self.pending;
        let mut best = 0;
        for stop in &self.stops {
            let longest = (stop.len() - 1).min(p.len());
            for len in (best + 1..=longest).rev() {
                let start = p.len() - len;
                if p.is_char_boundary(start) && stop.starts_with(&p[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(stops: &[&str], include: bool, pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops, include);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopCheck::Continue(t) => out.push_str(&t),
                StopCheck::Stopped { text, stop } => {
                    out.push_str(&text);
                    return (out, Some(stop));
                }
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn a_stop_string_split_over_tokens_is_found() {
        let (out, stop) = run(&["STOP"], false, &["hello S", "T", "OP and more"]);
        assert_eq!(out, "hello ");
        assert_eq!(stop.as_deref(), Some("STOP"));
        let (out, _) = run(&["STOP"], true, &["hello S", "T", "OP and more"]);
        assert_eq!(out, "hello STOP");
    }

    #[test]
    fn a_false_start_is_released() {
        let stops = vec!["STOP".to_string()];
        let mut m = StopMatcher::new(&stops, false);
        assert_eq!(
            m.push("abc ST"),
            StopCheck::Continue("abc ".into()),
            "\"ST\" held back"
        );
        assert_eq!(m.push("x"), StopCheck::Continue("STx".into()));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_is_safe() {
        let (out, stop) = run(&["wörld", "é"], false, &["h", "é", "llo wörld"]);
        assert_eq!(out, "h");
        assert_eq!(stop.as_deref(), Some("é"));
        let (out, stop) = run(&["€€"], false, &["a€", "b€", "€c"]);
        assert_eq!(out, "a€b");
        assert_eq!(stop.as_deref(), Some("€€"));
    }

    proptest! {
        /// However the text is split into pieces, the output is the text up to the first
        /// stop string, and nothing after a stop string is ever emitted.
        #[test]
        fn output_does_not_depend_on_how_text_is_split(
            text in "[ab€ ]{0,40}",
            cuts in proptest::collection::vec(0usize..40, 0..8),
            stop in "[ab€]{1,3}",
        ) {
            let chars: Vec<char> = text.chars().collect();
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(chars.len())).collect();
            bounds.push(0);
            bounds.push(chars.len());
            bounds.sort_unstable();
            bounds.dedup();
            let pieces: Vec<String> = bounds.windows(2).map(|w| chars[w[0]..w[1]].iter().collect()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (out, found) = run(&[&stop], false, &refs);
            let expected = match text.find(&stop) {
                Some(at) => text[..at].to_string(),
                None => text.clone(),
            };
            prop_assert_eq!(out, expected);
            prop_assert_eq!(found.is_some(), text.contains(&stop));
        }
    }
}
