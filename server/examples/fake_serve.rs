//! A server over fake attention nodes (no model): for trying clients and measuring the HTTP and
//! scheduling overhead alone.
//!
//! ```text
//! cargo run --release -p server --example fake_serve -- [PORT] [NODES] [STEP_DELAY_US]
//! ```
//! It synthesizes a tiny GPT-OSS tokenizer in a temporary folder; tokens come from a hash of
//! each sequence (see `router::fake`).

use router::fake::{FakeNode, FakeNodeConfig};
use router::{Router, RouterConfig, SchedulerConfig};
use server::{Server, ServerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().map(|p| p.parse()).transpose()?.unwrap_or(8000);
    let nodes: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(1);
    let delay_us: u64 = args.next().map(|n| n.parse()).transpose()?.unwrap_or(0);
    let dir = tempfile::tempdir()?;
    let options = model::synth::SynthOptions {
        family: model::Family::GptOss,
        preset: model::synth::Preset::Tiny,
        format: None,
        seed: 0,
        config_only: true,
    };
    model::synth::synthesize(dir.path(), &options, &mut |_, _| {})?;
    let list = (0..nodes)
        .map(|_| {
            let config = FakeNodeConfig {
                step_delay: std::time::Duration::from_micros(delay_us),
                ..Default::default()
            };
            Box::new(FakeNode::new(config)) as Box<dyn step::AttentionNode>
        })
        .collect();
    let router = Router::start(
        RouterConfig {
            scheduler: SchedulerConfig {
                max_model_len: 4096,
                ..Default::default()
            },
            ..Default::default()
        },
        list,
    )?;
    let config = ServerConfig {
        port,
        model_dir: dir.path().to_path_buf(),
        served_model_name: Some("fake".into()),
        ..Default::default()
    };
    let server = Server::bind(config, router, None).await?;
    eprintln!("fake server on http://{}", server.local_addr());
    server.run().await?;
    Ok(())
}
