//! A router's view of a remote attention node's cards: a task that asks the node's `Health`
//! a few times a second, so admission and `/health` read it without a call of their own.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::control::HealthRequest;
use proto::control::attention_client::AttentionClient;
use step::{HealthSource, NodeHealth};

use super::convert::health_from_pb;

/// How often the node is asked.
const POLL: Duration = Duration::from_millis(250);
/// How long one answer may take before the node counts as unreachable.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// The last answer of a remote node.
#[derive(Debug, Default)]
pub(super) struct RemoteHealth {
    last: Mutex<NodeHealth>,
}

impl HealthSource for RemoteHealth {
    fn health(&self) -> NodeHealth {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl RemoteHealth {
    fn set(&self, health: NodeHealth) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = health;
    }

    /// Keeps the cards as last seen, with the node itself as the reason nothing is served.
    fn unreachable(&self, why: String) {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).unserved = Some(why);
    }
}

/// Asks the node at `address` for its health until the task is aborted.
pub(super) async fn poll(
    mut client: AttentionClient<tonic::transport::Channel>,
    health: Arc<RemoteHealth>,
    address: String,
) {
    loop {
        match tokio::time::timeout(ANSWER_WITHIN, client.health(HealthRequest {})).await {
            Ok(Ok(reply)) => health.set(health_from_pb(&reply.into_inner())),
            Ok(Err(status)) => health.unreachable(format!(
                "attention node at {address} does not answer: {}",
                status.message()
            )),
            Err(_) => health.unreachable(format!(
                "attention node at {address} did not answer within {ANSWER_WITHIN:?}"
            )),
        }
        tokio::time::sleep(POLL).await;
    }
}
