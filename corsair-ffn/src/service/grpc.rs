//! The tonic `Card` service over a [`CardHost`], for cards in their own processes.

use std::sync::Arc;

use proto::control::card_server::{Card as CardRpc, CardServer};
use proto::control::{
    CardStats, HealthReply, HealthRequest, LoadShardReply, LoadShardRequest, ReleaseShardsReply,
    ReleaseShardsRequest, StageShardReply, StageShardRequest, StatsRequest,
};
use tonic::{Request, Response, Status};

use super::{CardHost, ServiceError};

/// The gRPC face of a card.
#[derive(Debug, Clone)]
pub struct CardService {
    host: Arc<CardHost>,
}

impl CardService {
    /// Serves `host`.
    pub fn new(host: Arc<CardHost>) -> Self {
        CardService { host }
    }

    /// As a tonic server.
    pub fn into_server(self) -> CardServer<Self> {
        CardServer::new(self)
    }
}

fn status(e: ServiceError) -> Status {
    match e {
        ServiceError::Refused(m) => Status::failed_precondition(m),
        ServiceError::Invalid(m) => Status::invalid_argument(m),
        e @ (ServiceError::AssignmentJson(_) | ServiceError::AttentionAddr(_)) => {
            Status::invalid_argument(e.to_string())
        }
        e @ ServiceError::ReadConfig { .. } => Status::failed_precondition(e.to_string()),
        e @ ServiceError::WorkerThread(_) => Status::internal(e.to_string()),
        ServiceError::Card(e) => Status::failed_precondition(e.to_string()),
        ServiceError::Transport(e) => Status::unavailable(e.to_string()),
    }
}

#[tonic::async_trait]
impl CardRpc for CardService {
    async fn load_shard(
        &self,
        request: Request<LoadShardRequest>,
    ) -> Result<Response<LoadShardReply>, Status> {
        let host = self.host.clone();
        let req = request.into_inner();
        // Compiling and loading weights is blocking work.
        let reply = tokio::task::spawn_blocking(move || host.load_shard(&req))
            .await
            .map_err(|e| Status::internal(format!("the loader panicked: {e}")))?
            .map_err(status)?;
        Ok(Response::new(reply))
    }

    async fn stage_shard(
        &self,
        request: Request<StageShardRequest>,
    ) -> Result<Response<StageShardReply>, Status> {
        let host = self.host.clone();
        let req = request.into_inner();
        // Compiling and loading weights is blocking work; the card serves meanwhile.
        let reply = tokio::task::spawn_blocking(move || host.stage_shard(&req))
            .await
            .map_err(|e| Status::internal(format!("the loader panicked: {e}")))?
            .map_err(status)?;
        Ok(Response::new(reply))
    }

    async fn release_shards(
        &self,
        request: Request<ReleaseShardsRequest>,
    ) -> Result<Response<ReleaseShardsReply>, Status> {
        let host = self.host.clone();
        let req = request.into_inner();
        // Freeing a program's weights can take a while on a large shard.
        let reply = tokio::task::spawn_blocking(move || host.release_shards(&req))
            .await
            .map_err(|e| Status::internal(format!("the release panicked: {e}")))?
            .map_err(status)?;
        Ok(Response::new(reply))
    }

    async fn health(
        &self,
        _request: Request<HealthRequest>,
    ) -> Result<Response<HealthReply>, Status> {
        Ok(Response::new(self.host.health()))
    }

    async fn stats(&self, _request: Request<StatsRequest>) -> Result<Response<CardStats>, Status> {
        Ok(Response::new(self.host.stats()))
    }
}
