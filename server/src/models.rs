//! `GET /v1/models`: one model card, with vLLM's `root` and `max_model_len`.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use crate::state::AppState;

/// The handler.
pub async fn list_models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "afd",
            "root": state.model_root,
            "parent": null,
            "max_model_len": state.limits.max_model_len,
            "permission": [{
                "id": format!("modelperm-{:032x}", rand::random::<u128>()),
                "object": "model_permission",
                "created": state.created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false
            }]
        }]
    }))
}
