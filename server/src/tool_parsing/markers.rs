//! Finding markers (`<|end|>`, `<tool_call>`, ...) in streamed text.
//!
//! Text arrives in pieces that may cut a marker anywhere, so a parser emits only the text that
//! cannot be the start of a marker and holds back the rest until the next piece decides it.

/// The earliest occurrence of any of `markers` in `text`: its byte offset and the marker's
/// index in `markers` (the longest marker when two start at the same place).
pub fn find_marker(text: &str, markers: &[&str]) -> Option<(usize, usize)> {
    markers
        .iter()
        .enumerate()
        .filter_map(|(i, m)| text.find(m).map(|at| (at, i)))
        .min_by(|a, b| {
            a.0.cmp(&b.0)
                .then(markers[b.1].len().cmp(&markers[a.1].len()))
        })
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `markers`: the
/// bytes to hold back because the next piece may complete a marker with them.
pub fn partial_marker_len(text: &str, markers: &[&str]) -> usize {
    let mut best = 0;
    for marker in markers {
        let longest = marker.len().saturating_sub(1).min(text.len());
        for len in (best + 1..=longest).rev() {
            let start = text.len() - len;
            if text.is_char_boundary(start) && marker.starts_with(&text[start..]) {
                best = len;
                break;
            }
        }
    }
    best
}

/// The part of `text` that can be emitted now: everything but a trailing partial marker.
pub fn emittable_len(text: &str, markers: &[&str]) -> usize {
    text.len() - partial_marker_len(text, markers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_earliest_and_then_longest_marker_is_found() {
        let markers = ["<|end|>", "<|e", "x"];
        assert_eq!(find_marker("ab<|end|>x", &markers), Some((2, 0)));
        assert_eq!(find_marker("abx<|end|>", &markers), Some((2, 2)));
        assert_eq!(find_marker("abc", &markers), None);
    }

    #[test]
    fn a_partial_marker_at_the_end_is_held_back() {
        let markers = ["<tool_call>", "</tool_call>"];
        assert_eq!(partial_marker_len("text <tool", &markers), 5);
        assert_eq!(partial_marker_len("text </", &markers), 2);
        assert_eq!(partial_marker_len("text <x", &markers), 0);
        assert_eq!(
            partial_marker_len("<tool_call>", &markers),
            0,
            "a whole marker is not a partial one"
        );
        assert_eq!(emittable_len("é<", &markers), "é".len());
    }
}
