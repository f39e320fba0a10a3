//! Prompt logprobs: the log-probability the model gives each prompt token after the tokens
//! before it (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`), what scoring tasks
//! such as lm-evaluation-harness's loglikelihood read.
//!
//! The router asks for them per step entry ([`PromptScoring`]): the prompt token that follows
//! each new token. The node scores those rows from the same logits it samples from, unfiltered
//! and at temperature 1, and returns one [`PromptLogprobs`] per entry that asked.

use crate::{InvalidStep, MAX_TOP_LOGPROBS, SeqId};

/// What one step entry asks of the prompt tokens after its new tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptScoring {
    /// `next[i]` is the prompt token after the entry's `tokens[i]`. One shorter than `tokens`
    /// on a prompt's last chunk: what follows the prompt's last token is sampled, not scored.
    pub next: Vec<u32>,
    /// The most likely alternatives to return per position (0 to
    /// [`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: usize,
}

impl PromptScoring {
    /// The scoring of the prompt tokens after `chunk` (positions `start..start + len`) of
    /// `prompt`, or `None` when no token of the chunk is followed by a prompt token.
    pub fn for_chunk(
        prompt: &[u32],
        start: usize,
        len: usize,
        top_logprobs: usize,
    ) -> Option<Self> {
        let end = (start + len + 1).min(prompt.len());
        (start + 1 < end).then(|| PromptScoring {
            next: prompt[start + 1..end].to_vec(),
            top_logprobs,
        })
    }

    /// Checks the request against the entry it rides on (`new_tokens` of them).
    pub fn check(&self, seq: SeqId, new_tokens: usize) -> Result<(), crate::StepError> {
        if self.next.is_empty() || self.next.len() > new_tokens {
            return Err(InvalidStep::PromptScoring {
                seq,
                scored: self.next.len(),
                new_tokens,
            }
            .into());
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(InvalidStep::TooManyTopLogprobs {
                asked: self.top_logprobs,
                max: MAX_TOP_LOGPROBS,
            }
            .into());
        }
        Ok(())
    }
}

/// One scored prompt token.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredToken {
    /// The prompt token.
    pub token: u32,
    /// Its log-probability after the tokens before it (temperature 1, no filters, no
    /// penalties).
    pub logprob: f32,
    /// The most likely tokens at its position with their log-probabilities, best first
    /// (lowest id first on ties).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The scored prompt tokens of one entry, in order (one per [`PromptScoring::next`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobs {
    /// The sequence.
    pub seq: SeqId,
    /// One per scored token.
    pub tokens: Vec<ScoredToken>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_scores_the_prompt_tokens_after_its_tokens() {
        let prompt = [10, 11, 12, 13, 14];
        let first = PromptScoring::for_chunk(&prompt, 0, 2, 0).unwrap();
        assert_eq!(
            first.next,
            vec![11, 12],
            "a middle chunk scores one per token"
        );
        let last = PromptScoring::for_chunk(&prompt, 2, 3, 1).unwrap();
        assert_eq!(last.next, vec![13, 14], "the last chunk scores one fewer");
        assert_eq!(last.top_logprobs, 1);
        assert_eq!(
            PromptScoring::for_chunk(&prompt, 4, 1, 0),
            None,
            "after the prompt's last token comes a sampled token"
        );
        assert_eq!(
            PromptScoring::for_chunk(&[7], 0, 1, 0),
            None,
            "a one-token prompt"
        );
        assert_eq!(
            PromptScoring::for_chunk(&prompt, 0, 5, 0).unwrap().next,
            vec![11, 12, 13, 14],
            "the whole prompt in one chunk"
        );
    }

    #[test]
    fn check_refuses_more_scores_than_tokens_and_too_many_alternatives() {
        let s = PromptScoring {
            next: vec![1, 2],
            top_logprobs: 0,
        };
        assert!(s.check(1, 2).is_ok());
        assert!(s.check(1, 3).is_ok(), "the entry may have one token more");
        assert!(s.check(1, 1).is_err(), "two scores after one token");
        let wide = PromptScoring {
            next: vec![1],
            top_logprobs: MAX_TOP_LOGPROBS + 1,
        };
        assert!(wide.check(1, 1).is_err());
        let empty = PromptScoring {
            next: vec![],
            top_logprobs: 0,
        };
        assert!(empty.check(1, 1).is_err(), "an empty request is not sent");
    }
}
