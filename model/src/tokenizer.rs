//! The checkpoint's tokenizer (`tokenizer.json`), its special tokens and chat template.
//!
//! The chat template is only loaded here (from `chat_template.jinja`, or the `chat_template`
//! key of `tokenizer_config.json`); rendering it is the HTTP server's business.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// A checkpoint's tokenizer with the metadata generation needs.
#[derive(Debug, Clone)]
pub struct ModelTokenizer {
    inner: tokenizers::Tokenizer,
    /// Jinja chat template, if the checkpoint ships one.
    pub chat_template: Option<String>,
    /// `bos_token` of tokenizer_config.json.
    pub bos_token: Option<String>,
    /// `eos_token` of tokenizer_config.json.
    pub eos_token: Option<String>,
    /// Every id that ends generation: config.json, generation_config.json and the eos token.
    pub eos_token_ids: Vec<u32>,
}

fn read_json(path: &Path, what: &'static str) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Json {
            path: path.to_path_buf(),
            what,
            source: e,
        })
}

/// A token given either as a string or as `{"content": ...}` (AddedToken).
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|i| vec![i as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|i| i as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelTokenizer {
    /// Loads `dir/tokenizer.json` and the metadata around it.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::Tokenizer(format!(
                "{} not found: the checkpoint needs a tokenizer.json for text prompts \
                 (token-id prompts work without one)",
                path.display()
            )));
        }
        let inner =
            tokenizers::Tokenizer::from_file(&path).map_err(|source| Error::TokenizerLoad {
                path: path.clone(),
                source,
            })?;
        let config = read_json(&dir.join("tokenizer_config.json"), "tokenizer_config.json")?;
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?)
        } else {
            config.as_ref().and_then(|c| match c.get("chat_template")? {
                Value::String(s) => Some(s.clone()),
                // A list of named templates: take "default", else the first.
                Value::Array(list) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
                _ => None,
            })
        };
        let bos_token = config
            .as_ref()
            .and_then(|c| token_string(c.get("bos_token")));
        let eos_token = config
            .as_ref()
            .and_then(|c| token_string(c.get("eos_token")));
        let mut eos: BTreeSet<u32> = BTreeSet::new();
        for file in ["config.json", "generation_config.json"] {
            if let Some(v) = read_json(&dir.join(file), "JSON file")? {
                eos.extend(ids(v.get("eos_token_id")));
            }
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos.insert(id);
        }
        Ok(ModelTokenizer {
            inner,
            chat_template,
            bos_token,
            eos_token,
            eos_token_ids: eos.into_iter().collect(),
        })
    }

    /// Token ids of `text`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(Error::TokenizerCodec)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(Error::TokenizerCodec)
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Size of the tokenizer's vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// What each token id of `0..len` stands for, as bytes: what constrained decoding matches
    /// a grammar against. Byte-level BPE (GPT-OSS, Qwen3) maps its printable characters back
    /// to bytes; SentencePiece-style vocabularies (Mixtral) turn `▁` into a space and `<0xNN>`
    /// byte-fallback tokens into their byte. `len` is the model's vocabulary, which may be
    /// larger than the tokenizer's (padding rows are [`TokenPiece::Unused`]).
    pub fn token_pieces(&self, len: usize) -> Vec<TokenPiece> {
        let decoder = self
            .inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .unwrap_or_default();
        let byte_level = decoder.contains("ByteLevel");
        let byte_fallback = decoder.contains("ByteFallback");
        let metaspace = decoder.contains('\u{2581}') || decoder.contains("Metaspace");
        let from_char: std::collections::HashMap<char, u8> = byte_to_char()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let added = self.inner.get_added_tokens_decoder();
        (0..len as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return if t.special {
                        TokenPiece::Special(t.content.clone())
                    } else {
                        TokenPiece::Bytes(t.content.as_bytes().to_vec())
                    };
                }
                let Some(token) = self.inner.id_to_token(id) else {
                    return TokenPiece::Unused;
                };
                if byte_level {
                    let bytes: Option<Vec<u8>> =
                        token.chars().map(|c| from_char.get(&c).copied()).collect();
                    // A character outside the byte map: the token is its UTF-8 text.
                    return TokenPiece::Bytes(bytes.unwrap_or_else(|| token.into_bytes()));
                }
                if byte_fallback
                    && let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
                    && let Ok(b) = u8::from_str_radix(hex, 16)
                {
                    return TokenPiece::Bytes(vec![b]);
                }
                let text = if metaspace {
                    token.replace('\u{2581}', " ")
                } else {
                    token
                };
                TokenPiece::Bytes(text.into_bytes())
            })
            .collect()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// What one token id stands for ([`ModelTokenizer::token_pieces`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenPiece {
    /// Text: the bytes the token adds to the output.
    Bytes(Vec<u8>),
    /// A special token (`<|end|>`), by its name: never part of the text a grammar matches.
    Special(String),
    /// No token has this id.
    Unused,
}

/// GPT-2's byte -> printable character map used by byte-level BPE.
fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in map.iter_mut().enumerate() {
        let printable = (b'!'..=b'~').contains(&(b as u8))
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        *slot = if printable {
            char::from_u32(b as u32).unwrap_or('?')
        } else {
            let c = char::from_u32(next).unwrap_or('?');
            next += 1;
            c
        };
    }
    map
}

/// A byte-level BPE `tokenizer.json` with the 256 bytes as ids 0..256, no merges, and
/// `specials` as added special tokens from id 256 on. Used for synthetic checkpoints.
pub fn byte_level_tokenizer_json(specials: &[&str]) -> Value {
    let chars = byte_to_char();
    let vocab: serde_json::Map<String, Value> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), Value::from(i)))
        .collect();
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": 256 + i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_round_trip_with_specials() {
        let dir = tempfile::tempdir().unwrap();
        let json = byte_level_tokenizer_json(&["<|endoftext|>", "<|start|>"]);
        std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "<|endoftext|>", "chat_template": "{{ messages }}"}"#,
        )
        .unwrap();
        let t = ModelTokenizer::load(dir.path()).unwrap();
        let text = "héllo, wörld <|start|>!";
        let ids = t.encode(text, false).unwrap();
        assert!(ids.contains(&257), "special token kept whole: {ids:?}");
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        assert_eq!(t.eos_token_ids, vec![256]);
        assert_eq!(t.chat_template.as_deref(), Some("{{ messages }}"));
    }

    #[test]
    fn token_pieces_are_the_bytes_tokens_decode_to() {
        for dir in ["gpt-oss-bf16", "mixtral", "qwen3-moe"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures")
                .join(dir);
            let t = ModelTokenizer::load(&path).unwrap();
            let pieces = t.token_pieces(t.vocab_size() + 3);
            assert_eq!(pieces[t.vocab_size()], TokenPiece::Unused);
            let text = "Héllo wörld, {\"a\": [1, 2]}\n";
            let ids = t.encode(text, false).unwrap();
            let mut bytes = Vec::new();
            for &id in &ids {
                match &pieces[id as usize] {
                    TokenPiece::Bytes(b) => bytes.extend_from_slice(b),
                    other => panic!("{dir}: token {id} is {other:?}"),
                }
            }
            // SentencePiece adds a leading space the decoder strips.
            let got = String::from_utf8(bytes).unwrap();
            assert_eq!(got.trim_start_matches(' '), text, "{dir}");
            let eos = t.eos_token_ids[0];
            assert!(
                matches!(&pieces[eos as usize], TokenPiece::Special(_)),
                "{dir}: {:?}",
                pieces[eos as usize]
            );
        }
    }

    #[test]
    fn missing_tokenizer_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = ModelTokenizer::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
    }
}
