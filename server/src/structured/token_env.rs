//! The checkpoint's vocabulary as llguidance sees it, and a compiled grammar as a
//! [`TokenConstraint`] the router and the nodes understand.

use std::sync::{Mutex, PoisonError};

use llguidance::Matcher;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use model::{ModelTokenizer, TokenPiece};
use step::{TokenConstraint, TokenMask};

/// The vocabulary's bytes (special tokens behind llguidance's `0xFF` marker, so grammars can
/// name them as `<|end|>`).
pub(super) struct VocabularyEnv {
    trie: TokTrie,
}

impl VocabularyEnv {
    /// The vocabulary of `len` token ids (the model's logits), ending on `eos` (the first of
    /// `stop_ids`, all of which end the output).
    pub(super) fn new(tokenizer: &ModelTokenizer, len: usize, stop_ids: &[u32]) -> Self {
        let words: Vec<Vec<u8>> = tokenizer
            .token_pieces(len)
            .into_iter()
            .map(|piece| match piece {
                TokenPiece::Bytes(b) => b,
                TokenPiece::Special(name) => {
                    let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    b.extend_from_slice(name.as_bytes());
                    b
                }
                TokenPiece::Unused => Vec::new(),
            })
            .collect();
        let eos = stop_ids.first().copied().unwrap_or(0);
        let info = TokRxInfo::new(len as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(stop_ids);
        VocabularyEnv { trie }
    }
}

impl TokenizerEnv for VocabularyEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // The longest-match walk of the trie: any tokenization of the bytes satisfies the
        // grammar, and the tokenizer's own would add SentencePiece's leading `▁` to a piece
        // that continues the output.
        self.trie.greedy_tokenize(s)
    }
}

/// One choice's grammar state: llguidance's matcher behind a lock (the mask thread asks for
/// masks, the scheduler feeds it tokens, one after the other).
pub(super) struct GrammarConstraint {
    pub(super) matcher: Mutex<Matcher>,
    /// Token ids of the model's logits.
    pub(super) vocab: usize,
    /// The tokens that end the output (all a finished grammar allows).
    pub(super) stop_ids: Vec<u32>,
}

impl TokenConstraint for GrammarConstraint {
    fn next_mask(&self) -> Result<TokenMask, String> {
        let mut matcher = self.matcher.lock().unwrap_or_else(PoisonError::into_inner);
        // A finished grammar allows only the end of the output.
        let vob = matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let halves = vob.as_slice();
        let words: Vec<u64> = halves
            .chunks(2)
            .map(|w| u64::from(w[0]) | (u64::from(w.get(1).copied().unwrap_or(0)) << 32))
            .collect();
        Ok(TokenMask::from_words(self.vocab, &words))
    }

    fn accept(&self, token: u32) -> Result<(), String> {
        let mut matcher = self.matcher.lock().unwrap_or_else(PoisonError::into_inner);
        if matcher.is_stopped() && self.stop_ids.contains(&token) {
            // The grammar is complete and the output ends here.
            return Ok(());
        }
        matcher.consume_token(token).map_err(|e| e.to_string())
    }
}
