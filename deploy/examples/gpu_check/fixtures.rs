//! Part (a): every transformers fixture through the disaggregated pipeline with the attention
//! node on the device, on every card count asked for: greedy tokens equal, the logits that
//! chose them within 1e-4; and the GPU-only baseline's tokens.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use gpu_attention::device::DeviceMonolithicNode;
use gpu_attention::kv_cache::KvCacheConfig;
use gpu_attention::{DisaggregatedNode, driver};
use model::ModelWeights;
use model::generate::GenerationRequest;
use model::sampling::SamplingParams;
use safetensors::SafeTensors;

use super::Args;

const TOLERANCE: f32 = 1e-4;

/// A fixture's prompts with transformers' continuations, and its step logits
/// (`(prompt, [tokens * vocab])`).
struct Fixture {
    name: String,
    dir: PathBuf,
    cases: Vec<(Vec<u32>, Vec<u32>)>,
    steps: Vec<(usize, Vec<f32>)>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_u64())
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default()
}

impl Fixture {
    fn load(dir: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(dir.join("expected.json"))?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let cases = v["prompts"]
            .as_array()
            .context("expected.json has no prompts")?
            .iter()
            .map(|p| (ids(&p["ids"]), ids(&p["output_ids"])))
            .collect();
        let bytes = std::fs::read(dir.join("expected_logits.safetensors"))?;
        let st = SafeTensors::deserialize(&bytes)?;
        let mut steps = Vec::new();
        for i in 0..16 {
            if let Ok(t) = st.tensor(&format!("steps_{i}")) {
                let values = t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                steps.push((i, values));
            }
        }
        Ok(Fixture {
            name: dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            dir: dir.to_path_buf(),
            cases,
            steps,
        })
    }

    fn requests(&self) -> Vec<GenerationRequest> {
        self.cases
            .iter()
            .map(|(p, out)| GenerationRequest {
                prompt: p.clone(),
                max_tokens: out.len(),
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
            })
            .collect()
    }

    /// Tokens that match transformers' over every prompt, and how many there are.
    fn agreement(&self, outputs: &[Vec<u32>]) -> (usize, usize) {
        let mut same = 0;
        let mut total = 0;
        for ((_, want), got) in self.cases.iter().zip(outputs) {
            total += want.len();
            same += want.iter().zip(got).take_while(|(a, b)| a == b).count();
        }
        (same, total)
    }
}

fn node(args: &Args, dir: &Path, cards: usize) -> Result<(EmbeddedCluster, DisaggregatedNode)> {
    let mut config = ClusterConfig::new(dir, cards);
    config.transport = TransportKind::Inproc;
    config.node.device = args.device;
    config.node.kv.memory_bytes = 64 << 20;
    let mut cluster = EmbeddedCluster::start(&config, &mut |_| {})
        .with_context(|| format!("{} on {cards} cards", dir.display()))?;
    let node = cluster.take_nodes().remove(0);
    Ok((cluster, node))
}

fn outputs(
    node: &mut dyn step::AttentionNode,
    requests: &[GenerationRequest],
) -> Result<Vec<Vec<u32>>> {
    Ok(driver::generate(node, requests, 0)?
        .into_iter()
        .map(|g| g.output_ids)
        .collect())
}

/// Runs part (a); returns the number of failed checks.
pub fn run(args: &Args) -> Result<usize> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&args.fixtures)
        .with_context(|| format!("reading {}", args.fixtures.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").exists())
        .collect();
    dirs.sort();
    println!(
        "-- (a) transformers fixtures through the cards, attention on {} ({} fixtures)",
        args.device,
        dirs.len()
    );
    println!(
        "{:<18} {:>12} {:>14} {:>16}",
        "fixture", "path", "tokens", "max |dlogit|"
    );
    let mut failures = 0;
    for dir in &dirs {
        let f = Fixture::load(dir)?;
        let requests = f.requests();
        for &cards in &args.cards {
            let (_cluster, mut n) = node(args, &f.dir, cards)?;
            let (same, total) = f.agreement(&outputs(&mut n, &requests)?);
            failures += usize::from(same != total);
            println!(
                "{:<18} {:>12} {:>8}/{:<5} {:>16}",
                f.name,
                format!("{cards} card(s)"),
                same,
                total,
                "-"
            );
        }
        // The logits that chose each token of the prompts transformers kept them for.
        let (_cluster, mut n) = node(args, &f.dir, args.cards.first().copied().unwrap_or(2))?;
        let mut worst = 0f32;
        for (i, steps) in &f.steps {
            n.collect_logits(true);
            let request = &requests[*i];
            driver::generate(&mut n, std::slice::from_ref(request), 100 + *i as u64)?;
            let vocab = steps.len() / request.max_tokens.max(1);
            for (s, (_, l)) in n.take_logits().iter().enumerate() {
                let want = &steps[s * vocab..(s + 1) * vocab];
                let d = l
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                worst = worst.max(d);
            }
        }
        let bad = worst.is_nan() || worst > TOLERANCE;
        failures += usize::from(bad);
        println!(
            "{:<18} {:>12} {:>14} {:>16.3e}{}",
            f.name,
            "step logits",
            "-",
            worst,
            if bad { "  > 1e-4" } else { "" }
        );
        // The GPU-only baseline.
        let weights = ModelWeights::load(&f.dir)?;
        let kv = KvCacheConfig {
            memory_bytes: 64 << 20,
            ..KvCacheConfig::default()
        };
        let mut base = DeviceMonolithicNode::new(&weights, &kv, args.device)?;
        let (same, total) = f.agreement(&outputs(&mut base, &requests)?);
        failures += usize::from(same != total);
        println!(
            "{:<18} {:>12} {:>8}/{:<5} {:>16}",
            f.name, "GPU alone", same, total, "-"
        );
    }
    println!(
        "fixtures: {}",
        if failures == 0 {
            "every token equal, every logit within 1e-4".to_string()
        } else {
            format!("{failures} check(s) FAILED")
        }
    );
    Ok(failures)
}
