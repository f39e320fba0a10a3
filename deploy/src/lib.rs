//! Deployments and the `afd` binary.
//!
//! Owns deployment files (`deploy/deployments/*.toml`, [`deployment`]), the planner's shell
//! ([`plan`]: a deployment file as the `planner` crate's target, with card losses), the
//! local multi-process launcher, Kubernetes manifests, the assembly of a disaggregated deployment
//! ([`cluster`]), the control plane's mutual TLS ([`control_plane`]), the watchers that mark cards
//! down and bring them back ([`watch`]), a run's Chrome trace from the node's and the cards' spans
//! ([`timeline`]), and the command-line front end that starts any role.
//!
//! Must not: hold model numerics or protocol logic of its own; it wires the other crates together.

pub mod cluster;
pub mod control_plane;
pub mod deployment;
pub mod eplb;
pub mod error;
pub mod k8s;
pub mod launch;
pub mod load_placement;
pub mod plan;
pub mod process;
pub mod remote;
pub mod shutdown;
pub mod timeline;
pub mod watch;

pub use error::{Error, Result};
