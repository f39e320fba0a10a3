//! Reading a request's JSON body within the server's limits: a JSON content type (or none),
//! at most `max_body_bytes` (refused from `Content-Length` before a byte is read), and the
//! whole of it within `body_timeout`, so a client that announces a body and sends less cannot
//! hold the connection.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::ApiError;
use crate::state::AppState;

/// A request body read whole (the handlers parse it as JSON).
#[derive(Debug, Clone)]
pub struct JsonBody(pub Bytes);

/// Whether `headers` allow a JSON body: no `Content-Type`, `application/json` or any
/// `application/*+json`, with parameters (vLLM reads JSON from these and refuses the rest).
fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let text = value.to_str().unwrap_or("");
    let essence = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let json = essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"));
    if json {
        return Ok(());
    }
    Err(ApiError::UnsupportedMediaType(format!(
        "the body must be JSON: send `Content-Type: application/json` (got `{}`)",
        text.escape_debug()
    )))
}

fn too_large(limit: usize, got: Option<u64>) -> ApiError {
    let got = got.map(|n| format!(" ({n} bytes)")).unwrap_or_default();
    ApiError::PayloadTooLarge(format!(
        "the request body is larger than the server accepts{got}: at most {limit} bytes; send \
         fewer or shorter prompts per request"
    ))
}

impl FromRequest<Arc<AppState>> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        check_content_type(request.headers())?;
        let limit = state.config.max_body_bytes;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large(limit, declared));
        }
        let timeout = state.config.body_timeout;
        let read = Limited::new(request.into_body(), limit).collect();
        match tokio::time::timeout(timeout, read).await {
            Ok(Ok(collected)) => Ok(JsonBody(collected.to_bytes())),
            Ok(Err(e)) if e.is::<LengthLimitError>() => Err(too_large(limit, None)),
            Ok(Err(e)) => Err(ApiError::bad_request(format!(
                "the request body could not be read: {e}"
            ))),
            Err(_) => Err(ApiError::RequestTimeout(format!(
                "the request body did not arrive within {timeout:?}: send the whole body the \
                 Content-Length announces"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn json_content_types_pass_and_others_are_refused() {
        let mut h = HeaderMap::new();
        assert!(check_content_type(&h).is_ok(), "no content type");
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/vnd.api+json",
        ] {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ok));
            assert!(check_content_type(&h).is_ok(), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
        ] {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(bad));
            let e = check_content_type(&h).unwrap_err();
            assert_eq!(e.status().as_u16(), 415, "{bad}");
        }
    }
}
