//! The attention nodes' cards in `/health` and `/metrics`: which card is down, since when and
//! why, and how often cards failed and came back.

use router::Router;
use serde_json::{Value, json};
use step::{CardState, NodeHealth};

use crate::error::ApiError;
use crate::metrics::Metrics;

/// The cards that are not up, as JSON objects (node, card, state, reason, for_seconds).
fn cards_not_up(health: &[Option<NodeHealth>]) -> Vec<Value> {
    health
        .iter()
        .enumerate()
        .filter_map(|(node, h)| h.as_ref().map(|h| (node, h)))
        .flat_map(|(node, h)| {
            h.not_up().map(move |c| {
                json!({
                    "node": node,
                    "card": c.card,
                    "state": c.state,
                    "reason": c.reason,
                    "for_seconds": (c.for_seconds * 10.0).round() / 10.0,
                })
            })
        })
        .collect()
}

/// `/health`'s body while the server cannot serve: the error envelope (saying which card is
/// down when that is why) with the cards that are not up.
pub fn unhealthy_body(router: &Router) -> Value {
    let health = router.card_health();
    let why = health
        .iter()
        .enumerate()
        .find_map(|(i, h)| {
            let why = h.as_ref()?.unserved.as_ref()?;
            Some(if health.len() == 1 {
                why.clone()
            } else {
                format!("attention node {i}: {why}")
            })
        })
        .unwrap_or_else(|| {
            "unhealthy: an attention node's engine stopped or its last step failed; see the \
             server log"
                .into()
        });
    let mut body = serde_json::to_value(ApiError::Unavailable(why).body()).unwrap_or(Value::Null);
    body["cards"] = Value::Array(cards_not_up(&health));
    body
}

/// `/health`'s body while the server serves with cards down that replicas cover (`None` when
/// every card is up).
pub fn degraded_body(router: &Router) -> Option<Value> {
    let down = cards_not_up(&router.card_health());
    (!down.is_empty()).then(|| {
        json!({
            "status": "degraded: serving with cards down that replicas cover",
            "cards": down,
        })
    })
}

/// Records every card's state and counters in `metrics`.
pub fn record(metrics: &Metrics, router: &Router) {
    for (node, h) in router.card_health().iter().enumerate() {
        let Some(h) = h else { continue };
        for c in &h.cards {
            metrics.card(
                node,
                c.card,
                c.state == CardState::Up,
                c.failures,
                c.rejoins,
            );
        }
    }
}
