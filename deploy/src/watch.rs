//! The shell around an attention node's [`CardBoard`]: one thread per card asks the card's
//! control plane for its health a few times a second and reports what it learns; when the
//! board asks for it (a card that was down answers again, or restarted), the thread loads the
//! card's share in the placement in use (the node's first request, with the share and version
//! an expert move may have changed), points the node's
//! transport at the card's new data address, dials it there, and only then hands the new inbox
//! to the board: a step after the card is marked up finds the path open (a rejoin that handed
//! the inbox over first once raced the dial and answered one request 503).
//!
//! The threads hold the board weakly and stop once the node is gone.

use std::sync::{Arc, Weak};
use std::time::Duration;

use gpu_attention::cards::{Action, CardBoard, Heartbeat};
use jetstream::{EndpointRuntime, QuicTransport, Transport};
use proto::control::{HealthReply, LoadShardRequest};

use crate::cluster::CardControl;
use crate::eplb::ShardBook;
use crate::error::{Error, Result};

/// How the cards are watched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WatchConfig {
    /// Time between two heartbeats to one card.
    pub interval: Duration,
    /// How long one heartbeat may take; a card that misses
    /// [`gpu_attention::cards::MISSES_TO_DOWN`] in a row is down (one that cannot be reached
    /// at all is down at once).
    pub timeout: Duration,
    /// How long a rejoin may take to dial the card's data address before it counts as failed
    /// (and is tried again at the next heartbeat).
    pub rejoin_dial: Duration,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            interval: Duration::from_millis(200),
            timeout: Duration::from_millis(400),
            rejoin_dial: Duration::from_secs(5),
        }
    }
}

/// Why a heartbeat got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeartbeatError {
    /// The card could not be reached (refused, reset): its process is gone.
    Unreachable(String),
    /// No answer within the timeout: stalled, or a slow network.
    TimedOut(String),
}

/// One card as the watcher reaches it.
pub struct WatchedCard {
    /// Its control plane.
    pub control: Arc<dyn CardControl>,
    /// The request this node loaded (or attached to) the card's shard with.
    pub request: LoadShardRequest,
    /// The placement in use: a rejoin loads the card's share under it, which an expert move
    /// may have changed since the node connected.
    pub book: Arc<ShardBook>,
}

/// The node's QUIC transport and the runtime that drives it: what a rejoin renews and dials.
pub struct NodeLink<'a> {
    /// The transport.
    pub quic: &'a Arc<QuicTransport>,
    /// Its endpoint's runtime.
    pub runtime: &'a Arc<EndpointRuntime>,
}

/// Starts one thread per card of `board`, each running until the board is dropped (with the
/// node and whoever reads its health). `link` is the node's transport, whose address book and
/// connection to a card are renewed when the card rejoins (`None`: in-process).
pub fn watch_cards(
    board: &Arc<CardBoard>,
    cards: Vec<WatchedCard>,
    link: Option<NodeLink<'_>>,
    config: WatchConfig,
) -> Result<()> {
    for (index, card) in cards.into_iter().enumerate() {
        let watcher = Watcher {
            index,
            card,
            board: Arc::downgrade(board),
            quic: link
                .as_ref()
                .map(|l| (Arc::downgrade(l.quic), Arc::downgrade(l.runtime))),
            config,
        };
        std::thread::Builder::new()
            .name(format!("afd-watch-card-{index}"))
            .spawn(move || watcher.run())
            .map_err(Error::system("cannot start a card watcher thread"))?;
    }
    Ok(())
}

struct Watcher {
    index: usize,
    card: WatchedCard,
    board: Weak<CardBoard>,
    /// Held weakly, as the board is: a watcher must not keep a gone node's endpoint alive.
    quic: Option<(Weak<QuicTransport>, Weak<EndpointRuntime>)>,
    config: WatchConfig,
}

impl Watcher {
    fn run(self) {
        while let Some(board) = self.board.upgrade() {
            match self.card.control.health(self.config.timeout) {
                Ok(reply) => {
                    if board.heartbeat(self.index, self.beat(&reply)) == Action::Rejoin {
                        self.rejoin(&board);
                    }
                }
                Err(HeartbeatError::Unreachable(why)) => board.missed(self.index, &why, true),
                Err(HeartbeatError::TimedOut(why)) => board.missed(self.index, &why, false),
            }
            drop(board);
            std::thread::sleep(self.config.interval);
        }
    }

    fn beat(&self, reply: &HealthReply) -> Heartbeat {
        Heartbeat {
            incarnation: reply.incarnation,
            serves_us: reply.attached.contains(&self.card.request.attention_node),
        }
    }

    /// Loads the card's shard again and hands the new inbox to the board.
    fn rejoin(&self, board: &CardBoard) {
        let card = self.index;
        let mut request = self.card.request.clone();
        if let Some((version, share)) = self.card.book.card(card) {
            match serde_json::to_string(&share) {
                Ok(json) => {
                    request.assignment_json = json;
                    request.shard_version = version;
                }
                Err(e) => return board.rejoin_failed(card, &e.to_string()),
            }
        }
        let answer = match self.card.control.load_shard(request) {
            Ok(answer) => answer,
            Err(e) => return board.rejoin_failed(card, &e.to_string()),
        };
        let Some(inbox) = answer.inbox else {
            return board.rejoin_failed(card, "the card returned no inbox");
        };
        if let Some((quic, runtime)) = self
            .quic
            .as_ref()
            .and_then(|(q, r)| q.upgrade().zip(r.upgrade()))
        {
            match answer.card_data_addr.parse() {
                Ok(addr) => quic.add_peer(answer.card_node.clone(), addr),
                Err(e) => {
                    let why = format!("bad data address `{}`: {e}", answer.card_data_addr);
                    return board.rejoin_failed(card, &why);
                }
            }
            // The old connection may still look open (a killed process sends no close): the
            // next write must dial the card where it is now.
            quic.reset_peer(&answer.card_node);
            let dial = runtime.block_on(async {
                tokio::time::timeout(self.config.rejoin_dial, quic.connect(&answer.card_node)).await
            });
            let why = match dial {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {:?}", self.config.rejoin_dial)),
            };
            if let Some(why) = why {
                // The next heartbeat asks for the rejoin again.
                let why = format!("cannot dial the card at {}: {why}", answer.card_data_addr);
                return board.rejoin_failed(card, &why);
            }
        }
        board.rejoined(
            card,
            answer.incarnation,
            jetstream::RegionDescriptor {
                node: inbox.node,
                id: inbox.id,
                len: inbox.len,
                key: inbox.key,
            },
        );
    }
}
