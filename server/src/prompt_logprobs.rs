//! Prompt logprobs in the two shapes clients read: vLLM's `prompt_logprobs` field, and the
//! prompt's part of a completion's legacy `logprobs` under `echo` (what lm-evaluation-harness's
//! loglikelihood tasks score).
//!
//! The router returns one [`ScoredToken`] per prompt token after the first; the first token has
//! nothing before it and is reported as null, as vLLM and OpenAI do.

use step::ScoredToken;

use crate::error::ApiError;
use crate::protocol::completions::{CompletionLogprobs, OrderedLogprobs};
use crate::protocol::prompt_logprobs::{
    PromptLogprobsField, PromptPositionLogprobs, PromptTokenLogprob,
};

/// Checks that `scores` cover `prompt` (one per token after the first).
fn check(prompt: &[u32], scores: &[ScoredToken]) -> Result<(), ApiError> {
    let want = prompt.len().saturating_sub(1);
    let matches =
        scores.len() == want && scores.iter().zip(&prompt[1..]).all(|(s, &t)| s.token == t);
    if matches {
        Ok(())
    } else {
        Err(ApiError::Internal(format!(
            "the node scored {} prompt tokens for a prompt of {}",
            scores.len(),
            prompt.len()
        )))
    }
}

/// vLLM's `prompt_logprobs` of `prompt` from its scores, with `top` alternatives per position
/// (the scores may carry more, when `echo` asked for more); `text` names a token.
pub fn vllm_field(
    prompt: &[u32],
    scores: &[ScoredToken],
    top: usize,
    text: impl Fn(u32) -> String,
) -> Result<PromptLogprobsField, ApiError> {
    check(prompt, scores)?;
    let mut field: PromptLogprobsField = Vec::with_capacity(prompt.len());
    if !prompt.is_empty() {
        field.push(None);
    }
    for s in scores {
        let alternatives = &s.top_logprobs[..top.min(s.top_logprobs.len())];
        let rank_of = |token: u32| alternatives.iter().position(|&(t, _)| t == token);
        let mut position = PromptPositionLogprobs(vec![(
            s.token,
            PromptTokenLogprob {
                logprob: s.logprob,
                rank: rank_of(s.token).map(|r| r + 1),
                decoded_token: text(s.token),
            },
        )]);
        for (r, &(t, logprob)) in alternatives.iter().enumerate() {
            if t != s.token {
                position.0.push((
                    t,
                    PromptTokenLogprob {
                        logprob,
                        rank: Some(r + 1),
                        decoded_token: text(t),
                    },
                ));
            }
        }
        field.push(Some(position));
    }
    Ok(field)
}

/// The prompt's part of a completion's legacy `logprobs` under `echo`: every prompt token's
/// text and offset, null logprobs for the first, then each token's logprob and its `top`
/// most likely alternatives (the token itself added when it is not among them, as for
/// generated tokens). Offsets count characters from the start of the echoed text.
pub fn echo_logprobs(
    prompt: &[u32],
    scores: &[ScoredToken],
    top: usize,
    text: impl Fn(u32) -> String,
) -> Result<(CompletionLogprobs, usize), ApiError> {
    check(prompt, scores)?;
    let mut lp = CompletionLogprobs::default();
    let mut offset = 0;
    for (i, &token) in prompt.iter().enumerate() {
        let piece = text(token);
        lp.text_offset.push(offset);
        offset += piece.chars().count();
        lp.tokens.push(piece);
        match i.checked_sub(1).map(|j| &scores[j]) {
            None => {
                lp.token_logprobs.push(None);
                lp.top_logprobs.push(None);
            }
            Some(s) => {
                lp.token_logprobs.push(Some(s.logprob));
                let mut alternatives: Vec<(String, f32)> = s
                    .top_logprobs
                    .iter()
                    .take(top)
                    .map(|&(t, l)| (text(t), l))
                    .collect();
                if !s.top_logprobs.iter().take(top).any(|&(t, _)| t == token) {
                    alternatives.push((text(token), s.logprob));
                }
                lp.top_logprobs.push(Some(OrderedLogprobs(alternatives)));
            }
        }
    }
    Ok((lp, offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(token: u32, logprob: f32, top: &[(u32, f32)]) -> ScoredToken {
        ScoredToken {
            token,
            logprob,
            top_logprobs: top.to_vec(),
        }
    }

    fn text(t: u32) -> String {
        format!("<{t}>")
    }

    #[test]
    fn the_vllm_field_is_null_first_then_the_token_and_its_alternatives() {
        let prompt = [5, 6, 7];
        let scores = [
            scored(6, -0.5, &[(6, -0.5), (9, -1.5)]),
            scored(7, -4.0, &[(1, -0.1), (2, -2.5)]),
        ];
        let field = vllm_field(&prompt, &scores, 2, text).unwrap();
        let narrow = serde_json::to_value(vllm_field(&prompt, &scores, 1, text).unwrap()).unwrap();
        assert_eq!(
            narrow[2].as_object().unwrap().len(),
            2,
            "the token and 1 alternative"
        );
        let json = serde_json::to_value(&field).unwrap();
        assert_eq!(json[0], serde_json::Value::Null);
        assert_eq!(json[1]["6"]["logprob"], -0.5);
        assert_eq!(json[1]["6"]["rank"], 1, "the prompt token is the best");
        assert_eq!(json[1]["9"]["rank"], 2);
        assert_eq!(json[1].as_object().unwrap().len(), 2, "the token once");
        assert_eq!(
            json[2]["7"]["rank"],
            serde_json::Value::Null,
            "outside the alternatives"
        );
        assert_eq!(json[2]["7"]["decoded_token"], "<7>");
        assert_eq!(json[2].as_object().unwrap().len(), 3);
        let keys: Vec<&String> = json[2].as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["7", "1", "2"],
            "the prompt token first, then best first"
        );
    }

    #[test]
    fn echo_logprobs_cover_every_prompt_token_with_offsets() {
        let prompt = [5, 16, 7];
        let scores = [
            scored(16, -0.5, &[(16, -0.5)]),
            scored(7, -4.0, &[(1, -0.1)]),
        ];
        let (lp, end) = echo_logprobs(&prompt, &scores, 1, text).unwrap();
        assert_eq!(lp.tokens, ["<5>", "<16>", "<7>"]);
        assert_eq!(lp.text_offset, [0, 3, 7]);
        assert_eq!(end, 10);
        assert_eq!(lp.token_logprobs, [None, Some(-0.5), Some(-4.0)]);
        assert_eq!(lp.top_logprobs[0], None);
        assert_eq!(
            lp.top_logprobs[1],
            Some(OrderedLogprobs(vec![("<16>".into(), -0.5)]))
        );
        assert_eq!(
            lp.top_logprobs[2],
            Some(OrderedLogprobs(vec![
                ("<1>".into(), -0.1),
                ("<7>".into(), -4.0)
            ])),
            "the prompt token joins its alternatives, as a generated token does"
        );
    }

    #[test]
    fn scores_that_do_not_match_the_prompt_are_an_internal_error() {
        let short = [scored(6, -0.5, &[])];
        assert!(vllm_field(&[5, 6, 7], &short, 0, text).is_err());
        let wrong = [scored(6, -0.5, &[]), scored(8, -1.0, &[])];
        assert!(echo_logprobs(&[5, 6, 7], &wrong, 0, text).is_err());
        assert_eq!(vllm_field(&[5], &[], 0, text).unwrap(), vec![None]);
    }
}
