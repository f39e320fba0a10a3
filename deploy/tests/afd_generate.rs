//! `afd generate --num-seqs N`: N copies of the prompt decoded side by side in one batch, one
//! JSON line each, every one the tokens that copy gets alone (with its own seed).

use serde_json::Value;

mod common;

use common::{afd_ok, fixture, generate_alone};

/// The output ids of each JSON line `afd generate` printed.
fn output_ids(stdout: &[u8]) -> Vec<Vec<u64>> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).expect("a JSON line");
            v["output_ids"]
                .as_array()
                .expect("output_ids")
                .iter()
                .map(|t| t.as_u64().expect("a token id"))
                .collect()
        })
        .collect()
}

fn generate(prompt: &str, extra: &[&str]) -> Vec<Vec<u64>> {
    let model = fixture("gpt-oss-bf16");
    output_ids(&afd_ok(|c| {
        c.arg("generate")
            .arg("--model")
            .arg(&model)
            .args(["--ignore-eos", "--cards", "2", "--max-tokens", "8"])
            .args(["--prompt-ids", prompt])
            .args(extra)
    }))
}

#[test]
fn a_batch_of_copies_gives_each_copy_its_own_tokens() {
    let prompt = "11,52,7,240,19";
    let alone = generate_alone(&fixture("gpt-oss-bf16"), &[11, 52, 7, 240, 19], 2, 8);
    let greedy = generate(prompt, &["--num-seqs", "3"]);
    assert_eq!(greedy, vec![alone.clone(); 3]);

    // Sampled copies take seeds 5 and 6: the second is what seed 6 gives alone.
    let sampled = generate(
        prompt,
        &["--num-seqs", "2", "--temperature", "1", "--seed", "5"],
    );
    assert_eq!(sampled.len(), 2);
    assert_ne!(sampled[0], sampled[1], "two seeds, one sampled sequence");
    let seed_6 = generate(prompt, &["--temperature", "1", "--seed", "6"]);
    assert_eq!(sampled[1], seed_6[0]);
    assert_eq!(
        sampled[0],
        generate(prompt, &["--temperature", "1", "--seed", "5"])[0]
    );
}
