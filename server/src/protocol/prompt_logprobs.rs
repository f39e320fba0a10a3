//! vLLM's `prompt_logprobs` response field: per prompt position, null for the first token
//! (nothing comes before it), then an object keyed by token id (as a string) holding the
//! prompt token and the most likely alternatives, each with its logprob, rank and text.

use serde::Serialize;
use serde::ser::SerializeMap;

/// One token at one prompt position.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PromptTokenLogprob {
    /// Its logprob (temperature 1, no filters, no penalties).
    pub logprob: f32,
    /// 1 for the most likely token, 2 for the next, ...: known for the returned alternatives;
    /// null for a prompt token outside them (the sharded LM head ranks only its candidates).
    pub rank: Option<usize>,
    /// Its text.
    pub decoded_token: String,
}

/// One prompt position: token id to its entry, the prompt token first, then the alternatives
/// best first (serialized as a JSON object).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptPositionLogprobs(pub Vec<(u32, PromptTokenLogprob)>);

impl Serialize for PromptPositionLogprobs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (id, entry) in &self.0 {
            map.serialize_entry(&id.to_string(), entry)?;
        }
        map.end()
    }
}

/// The whole field: `[null, {...}, {...}, ...]`, one per prompt token.
pub type PromptLogprobsField = Vec<Option<PromptPositionLogprobs>>;
