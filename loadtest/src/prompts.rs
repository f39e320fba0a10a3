//! The workload: one `RequestSpec` per measured request (prompt, its length, the output length).
//! Deterministic for a given seed, so every point of a sweep sends the same prompts.

use std::path::Path;

use rand::Rng;

use crate::config::{BenchmarkConfig, PromptSource};
use crate::error::Error;

/// A prompt as sent.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Token ids (completions only): `"prompt": [ids]`.
    TokenIds(Vec<u32>),
    /// Text: `"prompt": "..."`, or the text part of a chat message.
    Text(String),
}

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// The prompt.
    pub prompt: Prompt,
    /// The client's count of prompt tokens: exact for token ids, words for text. The result
    /// uses the server's `usage.prompt_tokens` instead whenever the server reports it.
    pub prompt_len: usize,
    /// Tokens asked for (`max_tokens` / `max_completion_tokens`).
    pub output_len: usize,
}

/// Common English words, most of them one token (with the leading space) in BPE vocabularies.
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "over",
    "new",
    "sound",
    "take",
    "only",
    "little",
    "work",
    "know",
    "place",
    "year",
    "live",
    "me",
    "back",
    "give",
    "most",
    "very",
    "after",
    "thing",
    "our",
    "just",
    "name",
    "good",
    "man",
    "think",
    "say",
    "great",
    "where",
    "help",
    "through",
    "much",
    "before",
    "line",
    "right",
    "too",
    "mean",
    "old",
    "any",
    "same",
    "tell",
    "boy",
    "follow",
    "came",
    "want",
    "show",
    "also",
    "around",
    "form",
    "three",
    "small",
    "set",
    "put",
    "end",
    "does",
    "another",
    "well",
    "large",
    "must",
    "big",
    "even",
    "such",
    "because",
    "turn",
    "here",
    "why",
    "ask",
    "went",
    "men",
    "read",
    "need",
    "land",
    "different",
    "home",
    "us",
    "move",
    "try",
    "kind",
    "hand",
    "picture",
    "again",
    "change",
    "off",
    "play",
    "spell",
    "air",
    "away",
    "animal",
    "house",
    "point",
    "page",
    "letter",
    "mother",
    "answer",
    "found",
    "study",
    "still",
    "learn",
    "should",
    "world",
    "high",
    "every",
    "near",
    "add",
    "food",
    "between",
    "own",
    "below",
    "country",
    "plant",
    "last",
    "school",
    "father",
    "keep",
    "tree",
    "never",
    "start",
    "city",
    "earth",
    "eye",
    "light",
    "thought",
    "head",
    "under",
    "story",
];

/// A length drawn uniformly from `[floor(len (1 - r)), ceil(len (1 + r))]`, at least `min`:
/// vLLM's random-dataset rule.
pub fn sample_length<R: Rng>(len: usize, range_ratio: f64, min: usize, rng: &mut R) -> usize {
    if range_ratio <= 0.0 {
        return len.max(min);
    }
    let low = ((len as f64) * (1.0 - range_ratio)).floor() as usize;
    let high = ((len as f64) * (1.0 + range_ratio)).ceil() as usize;
    let low = low.max(min);
    let high = high.max(low);
    rng.random_range(low..=high)
}

/// Builds the workload. Reads the prompt file for `PromptSource::File`; everything else is
/// computed from `rng`.
pub fn build_requests<R: Rng>(
    config: &BenchmarkConfig,
    rng: &mut R,
) -> Result<Vec<RequestSpec>, Error> {
    let p = &config.prompts;
    let n = config.num_prompts;
    match config.effective_prompt_source() {
        PromptSource::File(path) => {
            let lines = read_prompt_file(&path)?;
            let prefix = random_words(p.prefix_len, rng);
            let mut reqs = requests_from_lines(&lines, n, p.output_len, p.range_ratio, rng);
            if !prefix.is_empty() {
                for r in &mut reqs {
                    if let Prompt::Text(text) = &mut r.prompt {
                        *text = format!("{prefix} {text}");
                    }
                    r.prompt_len += p.prefix_len;
                }
            }
            Ok(reqs)
        }
        PromptSource::RandomWords => {
            let prefix = random_words(p.prefix_len, rng);
            Ok((0..n)
                .map(|_| {
                    let input = sample_length(p.input_len, p.range_ratio, 1, rng);
                    let output = sample_length(p.output_len, p.range_ratio, 1, rng);
                    let own = random_words(input, rng);
                    let text = if prefix.is_empty() {
                        own
                    } else {
                        format!("{prefix} {own}")
                    };
                    RequestSpec {
                        prompt: Prompt::Text(text),
                        prompt_len: p.prefix_len + input,
                        output_len: output,
                    }
                })
                .collect())
        }
        // Auto was resolved above; token ids are the remaining case.
        PromptSource::TokenIds | PromptSource::Auto => {
            let prefix: Vec<u32> = (0..p.prefix_len)
                .map(|_| rng.random_range(0..p.vocab_size))
                .collect();
            Ok((0..n)
                .map(|_| {
                    let input = sample_length(p.input_len, p.range_ratio, 1, rng);
                    let output = sample_length(p.output_len, p.range_ratio, 1, rng);
                    let mut ids = prefix.clone();
                    ids.extend((0..input).map(|_| rng.random_range(0..p.vocab_size)));
                    RequestSpec {
                        prompt_len: ids.len(),
                        prompt: Prompt::TokenIds(ids),
                        output_len: output,
                    }
                })
                .collect())
        }
    }
}

/// `count` random common words joined by spaces.
fn random_words<R: Rng>(count: usize, rng: &mut R) -> String {
    let words: Vec<&str> = (0..count)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    words.join(" ")
}

/// `n` requests cycling through `lines`; prompt lengths are word counts (an estimate).
pub fn requests_from_lines<R: Rng>(
    lines: &[String],
    n: usize,
    output_len: usize,
    range_ratio: f64,
    rng: &mut R,
) -> Vec<RequestSpec> {
    lines
        .iter()
        .cycle()
        .take(n)
        .map(|line| RequestSpec {
            prompt: Prompt::Text(line.clone()),
            prompt_len: line.split_whitespace().count(),
            output_len: sample_length(output_len, range_ratio, 1, rng),
        })
        .collect()
}

fn read_prompt_file(path: &Path) -> Result<Vec<String>, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::PromptFile {
        path: path.to_path_buf(),
        reason: format!("could not read it ({e})"),
        cause: Some(Box::new(e)),
    })?;
    let lines: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    if lines.is_empty() {
        return Err(Error::PromptFile {
            path: path.to_path_buf(),
            reason: "it holds no prompts: write one prompt per line".into(),
            cause: None,
        });
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EndpointKind, PromptConfig};
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn config(source: PromptSource, endpoint: EndpointKind) -> BenchmarkConfig {
        BenchmarkConfig {
            endpoint,
            num_prompts: 20,
            prompts: PromptConfig {
                source,
                input_len: 32,
                prefix_len: 0,
                output_len: 8,
                range_ratio: 0.0,
                vocab_size: 50,
            },
            ..BenchmarkConfig::default()
        }
    }

    #[test]
    fn token_id_prompts_are_exactly_sized_and_in_vocab() {
        let cfg = config(PromptSource::Auto, EndpointKind::Completions);
        let reqs = build_requests(&cfg, &mut StdRng::seed_from_u64(1)).unwrap();
        assert_eq!(reqs.len(), 20);
        for r in &reqs {
            let Prompt::TokenIds(ids) = &r.prompt else {
                panic!("completions with Auto must use token ids");
            };
            assert_eq!(ids.len(), 32);
            assert_eq!(r.prompt_len, 32);
            assert_eq!(r.output_len, 8);
            assert!(ids.iter().all(|&id| id < 50));
        }
    }

    #[test]
    fn chat_gets_word_prompts() {
        let cfg = config(PromptSource::Auto, EndpointKind::Chat);
        let reqs = build_requests(&cfg, &mut StdRng::seed_from_u64(1)).unwrap();
        let Prompt::Text(text) = &reqs[0].prompt else {
            panic!("chat must use text");
        };
        assert_eq!(text.split(' ').count(), 32);
    }

    #[test]
    fn a_shared_prefix_starts_every_prompt_and_the_rest_differs() {
        for endpoint in [EndpointKind::Completions, EndpointKind::Chat] {
            let mut cfg = config(PromptSource::Auto, endpoint);
            cfg.prompts.prefix_len = 24;
            cfg.prompts.vocab_size = 1000;
            let reqs = build_requests(&cfg, &mut StdRng::seed_from_u64(3)).unwrap();
            let tokens: Vec<Vec<String>> = reqs
                .iter()
                .map(|r| match &r.prompt {
                    Prompt::TokenIds(ids) => ids.iter().map(u32::to_string).collect(),
                    Prompt::Text(t) => t.split(' ').map(str::to_string).collect(),
                })
                .collect();
            for (r, t) in reqs.iter().zip(&tokens) {
                assert_eq!(t.len(), 24 + 32, "{endpoint:?}");
                assert_eq!(r.prompt_len, 24 + 32);
                assert_eq!(
                    t[..24],
                    tokens[0][..24],
                    "{endpoint:?}: the prefix is shared"
                );
            }
            assert_ne!(
                tokens[0][24..],
                tokens[1][24..],
                "{endpoint:?}: the rest is not"
            );
        }
    }

    #[test]
    fn prompt_file_cycles_and_rejects_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.txt");
        std::fs::write(&path, "hello there world\n\n  second prompt \n").unwrap();
        let cfg = config(PromptSource::File(path.clone()), EndpointKind::Completions);
        let reqs = build_requests(&cfg, &mut StdRng::seed_from_u64(1)).unwrap();
        assert_eq!(reqs[0].prompt, Prompt::Text("hello there world".into()));
        assert_eq!(reqs[1].prompt, Prompt::Text("second prompt".into()));
        assert_eq!(reqs[2].prompt, reqs[0].prompt);
        assert_eq!(reqs[0].prompt_len, 3);
        std::fs::write(&path, "\n \n").unwrap();
        let err = build_requests(&cfg, &mut StdRng::seed_from_u64(1)).unwrap_err();
        assert!(err.to_string().contains("no prompts"), "{err}");
        let missing = config(
            PromptSource::File(dir.path().join("missing.txt")),
            EndpointKind::Completions,
        );
        assert!(build_requests(&missing, &mut StdRng::seed_from_u64(1)).is_err());
    }

    proptest! {
        #[test]
        fn sampled_lengths_stay_in_range(len in 1usize..5000, r in 0.0f64..0.99, seed: u64) {
            let mut rng = StdRng::seed_from_u64(seed);
            let x = sample_length(len, r, 1, &mut rng);
            let low = (((len as f64) * (1.0 - r)).floor() as usize).max(1);
            let high = ((len as f64) * (1.0 + r)).ceil() as usize;
            prop_assert!(x >= low && x <= high.max(low), "{x} not in [{low}, {high}]");
        }
    }
}
