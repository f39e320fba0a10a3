//! The server's errors, and the one place they become HTTP responses.
//!
//! Bodies use the OpenAI/vLLM envelope `{"error": {"message", "type", "param", "code"}}`, with
//! `code` the HTTP status and `type` a stable name (also the label of the failure metric).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// A parameter is invalid (400); `param` names it.
    #[error("{message}")]
    BadRequest {
        /// What is wrong and what to do.
        message: String,
        /// The parameter at fault.
        param: Option<String>,
    },
    /// The model or route does not exist (404).
    #[error("{message}")]
    NotFound {
        /// What was not found.
        message: String,
        /// The parameter at fault.
        param: Option<String>,
    },
    /// The request lacks the server's API key (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The route exists but not for this method (405).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The client did not send its request in time (408).
    #[error("{0}")]
    RequestTimeout(String),
    /// The body is larger than the server accepts (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The request target is too long (414).
    #[error("{0}")]
    UriTooLong(String),
    /// The body is not JSON (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The request's headers are too large or too many (431).
    #[error("{0}")]
    HeadersTooLarge(String),
    /// Too many requests are waiting (429).
    #[error("{0}")]
    Overloaded(String),
    /// The server cannot serve now (503).
    #[error("{0}")]
    Unavailable(String),
    /// Something failed inside the server (500).
    #[error("{0}")]
    Internal(String),
}

/// The `error` object of the envelope.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorInfo {
    /// Human-readable message.
    pub message: String,
    /// Stable error type, e.g. `BadRequestError`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The parameter at fault, if any.
    pub param: Option<String>,
    /// The HTTP status.
    pub code: u16,
}

/// The envelope `{"error": ...}`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorInfo,
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// A 400 without a specific parameter.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UriTooLong(_) => StatusCode::URI_TOO_LONG,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable type name (vLLM's names).
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } => "BadRequestError",
            ApiError::NotFound { .. } => "NotFoundError",
            ApiError::Unauthorized(_) => "AuthenticationError",
            ApiError::MethodNotAllowed(_) => "MethodNotAllowedError",
            ApiError::RequestTimeout(_) => "RequestTimeoutError",
            ApiError::PayloadTooLarge(_) => "RequestEntityTooLargeError",
            ApiError::UriTooLong(_) => "RequestURITooLongError",
            ApiError::UnsupportedMediaType(_) => "UnsupportedMediaTypeError",
            ApiError::HeadersTooLarge(_) => "RequestHeaderFieldsTooLargeError",
            ApiError::Overloaded(_) => "TooManyRequestsError",
            ApiError::Unavailable(_) => "ServiceUnavailableError",
            ApiError::Internal(_) => "InternalServerError",
        }
    }

    /// The envelope as JSON text.
    pub fn json(&self) -> String {
        // Serializing strings and integers cannot fail; the fallback only satisfies the type.
        serde_json::to_string(&self.body()).unwrap_or_else(|_| {
            r#"{"error":{"message":"internal error","type":"InternalServerError","param":null,"code":500}}"#
                .to_string()
        })
    }

    /// The envelope.
    pub fn body(&self) -> ErrorBody {
        let param = match self {
            ApiError::BadRequest { param, .. } | ApiError::NotFound { param, .. } => param.clone(),
            _ => None,
        };
        ErrorBody {
            error: ErrorInfo {
                message: self.to_string(),
                kind: self.error_type().to_string(),
                param,
                code: self.status().as_u16(),
            },
        }
    }
}

/// Seconds a refused client is told to wait (`Retry-After` on 429 and 503): a waiting slot
/// frees as soon as one queued request starts, which on a busy server is within a step or two.
pub const RETRY_AFTER_SECONDS: u32 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if matches!(self, ApiError::Overloaded(_) | ApiError::Unavailable(_)) {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

impl From<router::Error> for ApiError {
    fn from(e: router::Error) -> Self {
        match e {
            router::Error::QueueFull { .. } => ApiError::Overloaded(e.to_string()),
            router::Error::InvalidRequest(_) | router::Error::TooManySequences { .. } => {
                ApiError::bad_request(e.to_string())
            }
            router::Error::NodeDown { .. }
            | router::Error::NoNodes
            | router::Error::CardsDown { .. } => ApiError::Unavailable(e.to_string()),
            router::Error::Config(_) | router::Error::EngineThread { .. } => {
                ApiError::Internal(e.to_string())
            }
        }
    }
}

impl From<router::GenerationError> for ApiError {
    fn from(e: router::GenerationError) -> Self {
        match e {
            router::GenerationError::Shutdown | router::GenerationError::Unavailable { .. } => {
                ApiError::Unavailable(e.to_string())
            }
            router::GenerationError::Step { .. } => ApiError::Internal(e.to_string()),
        }
    }
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The checkpoint's tokenizer or config could not be loaded.
    #[error("loading the model in {dir}: {source}")]
    Model {
        /// The checkpoint folder.
        dir: String,
        /// What failed.
        source: model::Error,
    },
    /// The chat template does not compile.
    #[error("the chat template does not compile: {0}")]
    ChatTemplate(#[source] minijinja::Error),
    /// The address could not be bound.
    #[error(
        "cannot listen on {addr}: {source}; is another server using the port? pick another with --port"
    )]
    Bind {
        /// The address.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A setting is invalid.
    #[error("invalid server configuration: {0}")]
    Config(String),
}
