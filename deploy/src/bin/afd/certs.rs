//! `afd certs`: make the cluster CA and one certificate per node for JetStream's mutual TLS.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

/// Arguments of `afd certs`.
#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory for the PEM files (created if missing). A CA already there is reused, so
    /// nodes can be added later; otherwise a new CA is made.
    #[arg(long)]
    pub out: PathBuf,
    /// Node names, comma-separated; each becomes the only name in its certificate
    /// (e.g. attn,card-0,card-1).
    #[arg(long, value_delimiter = ',', required = true)]
    pub nodes: Vec<String>,
}

/// Writes `ca.pem`, `ca.key.pem` and `NODE.pem`/`NODE.key.pem` for every node, then lists the
/// files written.
pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let nodes: Vec<String> = args
        .nodes
        .iter()
        .map(|node| node.trim().to_owned())
        .filter(|node| !node.is_empty())
        .collect();
    let written = jetstream::write_cluster(&args.out, &nodes)
        .with_context(|| format!("writing certificates into {}", args.out.display()))?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}
