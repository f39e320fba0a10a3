//! Streaming detokenization: text deltas that never split a UTF-8 character.
//!
//! Decoding tokens one at a time is wrong for byte-level tokenizers (a character may span
//! several tokens) and for SentencePiece ones (a token's leading space depends on what precedes
//! it). So, like vLLM's incremental detokenizer, each step decodes a small window twice: the
//! tokens already emitted since `prefix_offset` and the same plus the new ones; the difference
//! is the new text, held back while it ends in an incomplete character (U+FFFD).

use model::ModelTokenizer;

/// Prompt tokens used as left context of the first generated token.
const PROMPT_CONTEXT: usize = 5;

/// Token ids the tokenizer could not turn into text (an id outside its vocabulary, say).
#[derive(Debug, thiserror::Error)]
#[error("the tokenizer could not decode token ids {ids:?}: {source}")]
pub struct DecodeError {
    /// The ids it was given (the detokenizer's window: a few tokens).
    pub ids: Vec<u32>,
    /// The tokenizer's own error (boxed: it is large, and errors are rare).
    #[source]
    pub source: Box<model::Error>,
}

/// Anything that turns token ids into text.
pub trait TokenDecoder {
    /// Text of `ids`.
    fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, DecodeError>;
}

impl TokenDecoder for ModelTokenizer {
    fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, DecodeError> {
        self.decode(ids, skip_special_tokens)
            .map_err(|source| DecodeError {
                ids: ids.to_vec(),
                source: Box::new(source),
            })
    }
}

/// Incremental detokenizer of one sequence.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// A detokenizer whose output starts after `prompt` (its last tokens give context).
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Self {
        let context = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        IncrementalDetokenizer {
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special_tokens,
        }
    }

    /// Adds a token and returns the text it completes (possibly empty).
    pub fn push(&mut self, decoder: &dyn TokenDecoder, id: u32) -> Result<String, DecodeError> {
        self.ids.push(id);
        let prefix = decoder.decode_ids(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = decoder.decode_ids(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = if full.is_char_boundary(prefix.len()) && full.starts_with(&prefix) {
            full[prefix.len()..].to_string()
        } else {
            // The decoder rewrote the prefix (rare normalizations): emit the longest
            // unseen tail that starts on a character boundary.
            let mut cut = prefix.len().min(full.len());
            while !full.is_char_boundary(cut) {
                cut += 1;
            }
            full[cut..].to_string()
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Whatever is still held back (an incomplete character at the very end), as text with
    /// replacement characters; call once when the sequence ends.
    pub fn flush(&mut self, decoder: &dyn TokenDecoder) -> Result<String, DecodeError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = decoder.decode_ids(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = decoder.decode_ids(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let mut cut = prefix.len().min(full.len());
        while !full.is_char_boundary(cut) {
            cut += 1;
        }
        Ok(full[cut..].to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> (tempfile::TempDir, ModelTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let json = model::tokenizer::byte_level_tokenizer_json(&["<|end|>"]);
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        let t = ModelTokenizer::load(dir.path()).unwrap();
        (dir, t)
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let (_dir, t) = tokenizer();
        let text = "héllo wörld, 世界 🦀!";
        let ids = t.encode(text, false).unwrap();
        assert!(
            ids.len() > text.chars().count(),
            "byte-level: characters span tokens"
        );
        let mut d = IncrementalDetokenizer::new(&[], true);
        let mut out = String::new();
        for &id in &ids {
            let delta = d.push(&t, id).unwrap();
            assert!(
                !delta.contains('\u{FFFD}'),
                "half a character emitted: {delta:?}"
            );
            out.push_str(&delta);
        }
        out.push_str(&d.flush(&t).unwrap());
        assert_eq!(out, text);
    }

    #[test]
    fn prompt_context_is_not_repeated_and_specials_are_skipped() {
        let (_dir, t) = tokenizer();
        let prompt = t.encode("prompt text ", false).unwrap();
        let mut d = IncrementalDetokenizer::new(&prompt, true);
        let mut out = String::new();
        for id in t.encode("answer<|end|>", false).unwrap() {
            out.push_str(&d.push(&t, id).unwrap());
        }
        assert_eq!(out, "answer");
    }

    #[test]
    fn an_incomplete_character_at_the_end_is_flushed() {
        let (_dir, t) = tokenizer();
        let ids = t.encode("a€", false).unwrap(); // '€' is three bytes
        let mut d = IncrementalDetokenizer::new(&[], true);
        assert_eq!(d.push(&t, ids[0]).unwrap(), "a");
        assert_eq!(d.push(&t, ids[1]).unwrap(), "", "held back");
        assert_eq!(d.flush(&t).unwrap(), "\u{FFFD}");
    }
}
