//! `afd serve --record-routing FILE`: every attention node wrapped to count the experts its
//! steps route to, and the file the counts go to, rewritten now and then and at the end.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use step::AttentionNode;

use crate::serve::ServeArgs;

/// The attention nodes a router steps.
pub(crate) type Nodes = Vec<Box<dyn AttentionNode>>;

/// `--record-routing`: every node wrapped to count its routing, and the file the counts go to.
pub(crate) fn record_routing(
    args: &ServeArgs,
    nodes: Vec<Box<dyn AttentionNode>>,
    model_config: &model::ModelConfig,
    model_dir: &Path,
) -> anyhow::Result<(Nodes, Option<RoutingFile>)> {
    let frontend_only = !args.attention_addrs.is_empty();
    Ok(match &args.record_routing {
        Some(path) if !frontend_only => {
            let m = model_config.moe.with_context(|| {
                format!(
                    "--record-routing {}: {} has no experts to route to",
                    path.display(),
                    model_dir.display()
                )
            })?;
            let moe = model_config.moe_layers();
            let recorder = Arc::new(std::sync::Mutex::new(emulate::RoutingRecorder::new(
                &moe,
                m.num_experts,
                m.top_k,
                args.record_window,
            )));
            let nodes = nodes
                .into_iter()
                .map(|n| {
                    Box::new(emulate::record::RecordingNode::new(
                        n,
                        Arc::clone(&recorder) as Arc<dyn emulate::record::RoutingObserver>,
                    )) as Box<dyn AttentionNode>
                })
                .collect();
            (nodes, Some(RoutingFile::start(path.clone(), recorder)))
        }
        Some(_) => bail!(
            "--record-routing needs the attention nodes in this process; it does not work with \
             --attention-addrs"
        ),
        None => (nodes, None),
    })
}

/// `--record-routing`: the counts written to their file now and then, and at the end.
pub(crate) struct RoutingFile {
    path: PathBuf,
    recorder: Arc<std::sync::Mutex<emulate::RoutingRecorder>>,
    stop: std::sync::mpsc::Sender<()>,
    writer: std::thread::JoinHandle<()>,
}

/// How often `--record-routing` rewrites its file while serving.
const ROUTING_FILE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

impl RoutingFile {
    fn start(path: PathBuf, recorder: Arc<std::sync::Mutex<emulate::RoutingRecorder>>) -> Self {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (p, r) = (path.clone(), Arc::clone(&recorder));
        let writer = std::thread::spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(ROUTING_FILE_EVERY)
            {
                let counts = r.lock().unwrap_or_else(|e| e.into_inner()).counts().clone();
                if let Err(e) = counts.write(&p) {
                    tracing::warn!("--record-routing: {e}");
                }
            }
        });
        RoutingFile {
            path,
            recorder,
            stop,
            writer,
        }
    }

    /// Stops the periodic writer and writes the final counts.
    pub(crate) fn finish(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        let _ = self.writer.join();
        let counts = self
            .recorder
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .counts()
            .clone();
        counts.write(&self.path)?;
        let steps: u64 = counts.windows.iter().map(|w| w.steps).sum();
        eprintln!(
            "afd serve: wrote {} (the routing of {steps} steps)",
            self.path.display()
        );
        Ok(())
    }
}
